"""``train_step.py --backend jax``: the same GPT step on three engines, side by side.

1. minidist on NumPy (the reference engine);
2. minidist on JAX: eager per op, each op's forward/backward jitted once (minidist/accel/jax_engine.py);
   ``MINIDIST_JAX_JIT=0`` shows plain eager dispatch;
3. pure ``jax.jit`` of the whole step (minidist/parallel/spmd/program.py's twin on one device): the ceiling.

All three take SGD steps from the same weights on the same batch (the twin has SGD only); the
first-step losses must agree. Targets (issue 19): minidist-on-JAX within 2x of minidist-on-NumPy.
"""

from __future__ import annotations

import time

import numpy as np


def _median_ms(step, steps):
    first = time.perf_counter()
    step()
    first = time.perf_counter() - first
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return first, float(np.median(times)) * 1e3


def run(cfg, batch: int, steps: int) -> int:
    import jax

    from minidist.accel import jax_engine
    from minidist.accel.backend import get_backend, set_default_backend
    from minidist.nn import GPT, optim
    from minidist.parallel.spmd import SPMDProgram

    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (batch, cfg.block_size))
    y = rng.integers(0, cfg.vocab_size, (batch, cfg.block_size))
    rows, losses = {}, {}
    for name in ("numpy", "jax"):
        set_default_backend(name)
        be = get_backend(name)
        model = GPT(cfg, backend=name)
        opt = optim.SGD(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt, be=be, name=name):
            loss = model.loss(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            be.synchronize()
            losses.setdefault(name, float(be.to_host(loss.data)))

        before = jax_engine.compilations()
        rows[f"minidist on {name}" + (" (ops jitted)" if name == "jax" and jax_engine.enabled() else "")] = \
            _median_ms(step, steps)
        if name == "jax":
            first = jax_engine.compilations() - before
            step()
            compiled = (first, jax_engine.compilations() - before - first)
    set_default_backend(None)
    twin = SPMDProgram(cfg, 1, 1, lr=1e-3, devices=jax.devices()[:1])
    rows["pure jax.jit whole step"] = _median_ms(lambda: losses.setdefault("jit", twin.step(x, y)), steps)
    print(f"GPT step on JAX {jax.__version__} ({jax.devices()[0].platform}), SGD, median of {steps} "
          f"after the first (compiling) step:")
    base = rows["minidist on numpy"][1]
    for k, (first, ms) in rows.items():
        print(f"  {k:<34} {ms:9.1f} ms   ({ms / base:5.2f}x NumPy; first step {first:.1f} s)")
    print(f"minidist on JAX compiled {compiled[0]} programs in its first {steps + 1} steps (or loaded them "
          f"from the persistent cache), {compiled[1]} in the step after: one per op shape and direction, "
          f"one for the optimizer's whole update")
    jax_ms = next(ms for k, (_, ms) in rows.items() if k.startswith("minidist on jax"))
    print(f"target minidist-on-JAX <= 2x minidist-on-NumPy: {'MET' if jax_ms <= 2 * base else 'MISSED'}")
    agree = max(abs(v - losses["numpy"]) for v in losses.values()) <= 1e-4 * abs(losses["numpy"])
    print(f"first-step losses {', '.join(f'{k} {v:.6f}' for k, v in losses.items())}: "
          f"{'PASS' if agree else 'FAIL'}")
    return 0 if agree else 1
