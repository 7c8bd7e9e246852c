"""`python -m minidist.calibrate`: measure this machine once for the planner's `--hardware here`.

Measures, in one thread's CPU seconds (`cpu`: what the work costs on a core of its own, whatever
else runs): float32 matmul FLOP/s, memory bandwidth (a large copy), the cost of one autograd op
outside its arithmetic (forward + backward of a tiny add: Python and dispatch), the rates minidist's
own kernels reach (`kernels`: linear, GELU, layer norm, attention scores, cross-entropy, AdamW --
the planner's compute model for the "minidist" engine is a sum of these, with the Python of a block,
of the embedding + head, and of a training step per parameter tensor, times `cold`: a whole step
over the sum of its parts). In wall time, because sharing is what they measure: how many cores'
worth of work processes and thread ranks get (`threads`: as many thread ranks as the CPUs, 2 x and
4 x as many, a fixed batch split over them -- past the CPUs handing the GIL over costs more than
the cores give), the threads transport's ring all-reduce alpha (seconds per step) and beta
(seconds per byte) by a least-squares fit over message sizes, and (`processes`,
`minidist.plan.calibrate_mpi`'s mpirun probe) what 2, 4 and 8 MPI processes get at once: their cores'
worth of minidist work, what each op's Python loses besides, and their all-reduce's alpha/beta.
The load average is recorded: on a busy machine the cores' worth is less. Writes them to
~/.cache/minidist/calibration.json (`minidist.plan.hardware.CALIBRATION_PATH`);
`minidist.plan.hardware.here()` reads them back.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.comm import all_reduce, run
from minidist.nn import GPT, GPTConfig
from minidist.nn.optim import AdamW
from minidist.parallel.three_d import train_3d
from minidist.plan.estimates import fit_alpha_beta
from minidist.plan.hardware import CALIBRATION_PATH, Hardware, Link
from minidist.plan.mesh import Candidate
from minidist.plan.model import ModelSpec
from minidist.plan.steptime import LINK_RANKS, predict
from minidist.plan.traffic import all_reduce_rounds, all_reduce_sent


def _median_time(fn, repeats: int = 7, min_time: float = 0.02, clock=time.perf_counter) -> float:
    """Median seconds per call; each sample repeats `fn` for at least `min_time`, so a sample is a
    sustained rate (what a training step sees), not one lucky burst on a shared machine.
    `min_time=0` for collectives: every rank must call them the same number of times. `clock`:
    wall time, or `cpu` for the work of one thread alone (see `cpu`)."""
    fn()
    ts = []
    for _ in range(repeats):
        n, t0 = 0, clock()
        while True:
            fn()
            n += 1
            dt = clock() - t0
            if dt >= min_time:
                break
        ts.append(dt / n)
    return float(np.median(ts))


# What one thread's work costs on a core of its own is timed in that thread's CPU seconds, not wall
# seconds: another program taking the core for a while stretches the wall time of whatever runs
# (at load 7.7 on 2 vCPUs a single rank's wall-time calibration was 17-35% off, its CPU time 9-13%),
# but not the CPU seconds the work needs. How much of the cores the ranks get is measured apart, in
# wall time (`effective_cores`, the mpirun probe): that is where the load shows.
cpu = time.thread_time


def matmul_flops(n: int = 256) -> float:
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    return 2 * n**3 / _median_time(lambda: a @ a, clock=cpu)


def mem_bandwidth(nbytes: int = 64 << 20) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * nbytes / _median_time(lambda: np.copyto(dst, src), clock=cpu)  # read + write


def op_overhead(n: int = 200) -> float:
    """Seconds per op (forward + backward) of tiny tensors: everything but the arithmetic."""
    def chain():
        x = Tensor(np.ones((2, 2), np.float32), requires_grad=True)
        y = x
        for _ in range(n):
            y = y + x
        y.sum().backward()
    return _median_time(chain, clock=cpu) / (n + 1)


def _fwd_bwd(fn, *shapes, seed=0):
    """Median seconds of forward + backward of minidist op `fn` on float32 tensors of `shapes`."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def once():
        ts = [Tensor(a, requires_grad=True) for a in arrays]
        out = fn(*ts)
        out.backward(np.ones(out.shape, np.float32))
    return _median_time(once, 5, clock=cpu)


def kernels() -> dict:
    """What minidist's own ops achieve here, forward + backward, per unit of work:
    linear FLOP/s (3 matmuls of 2·m·k·n), seconds per element of GELU, of layer norm, of a plain
    elementwise op (add), per attention score (softmax, mask and their backward, the q·kᵀ and p·v
    matmuls taken out at the linear rate), per cross-entropy logit, and per parameter of AdamW."""
    b, s, k, n = 8, 64, 256, 256  # a batch of sequences (3-D input), as the model's layers see it
    lin = 3 * 2 * b * s * k * n / _fwd_bwd(lambda x, w: ops.linear(x, w), (b, s, k), (k, n))
    e = 256 * 1024
    gelu = _fwd_bwd(ops.gelu, (256, 1024)) / e
    ln = _fwd_bwd(lambda x, w, b: ops.layer_norm(x, w, b), (256, 1024), (1024,), (1024,)) / e
    add = _fwd_bwd(lambda a, b: a + b, (256, 1024), (256, 1024)) / e
    b, h, s, d = 8, 4, 64, 32
    scores = b * h * s * s
    t = _fwd_bwd(lambda q, kk, v: ops.scaled_dot_product_attention(q, kk, v), *[(b, h, s, d)] * 3)
    attn = max(t - 3 * 2 * 2 * scores * d / lin, 0.0) / scores
    logits = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    tgt = np.zeros(512, np.int64)

    def ce():
        x = Tensor(logits, requires_grad=True)
        ops.cross_entropy(x, tgt).backward()
    ce_t = _median_time(ce, 5, clock=cpu) / logits.size
    p = Tensor(np.zeros(1 << 20, np.float32), requires_grad=True)
    p.grad = np.ones(1 << 20, np.float32)
    opt = AdamW([p], lr=1e-3)
    adam = _median_time(opt.step, 5, clock=cpu) / p.size
    k = {"linear_flops": lin, "gelu": gelu, "layer_norm": ln, "elementwise": add, "attention_score": attn,
         "cross_entropy": ce_t, "adamw": adam, **python_costs()}
    return {**k, "cold": cold_factor(k)}


WHOLE_GPT = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, d_model=128)
WHOLE_ROWS = 4


def step_seconds(comm, cfg, data, clock=time.perf_counter, drop: int = 1, **layout) -> list:
    """Seconds of the steps of ``train_3d`` (AdamW) of ``cfg`` on ``data`` by ``clock``, from one step's
    end to the next: the first step is never timed, and ``drop`` more (warm-up) are left out, so
    ``len(data) - 1 - drop`` values. ``layout``: train_3d's dp, tp, pp, microbatches. Every timed
    step of the planner's calibration and benchmark comes from here."""
    marks = []
    train_3d(comm, cfg, data, optimizer="adamw", lr=1e-3, on_step=lambda s, st: marks.append(clock()),
             **layout)
    return list(np.diff(marks)[drop:])


def cold_factor(k: dict) -> float:
    """A whole training step over the sum of its parts: one thread rank trains `WHOLE_GPT`
    (`train_3d`, AdamW, `WHOLE_ROWS` sequences), timed in its CPU seconds, against the planner's
    sum of the ops at the rates `k` measured one op at a time. Each op was timed on its own, over
    and over, its arrays and code hot in the caches; in a step every op finds them holding the
    previous op's (~1.1 here). The planner multiplies a rank's work by it."""
    ids = np.random.default_rng(0).integers(0, WHOLE_GPT.vocab_size, (WHOLE_ROWS, WHOLE_GPT.block_size))

    def body(comm):
        return float(np.median(step_seconds(comm, WHOLE_GPT, [(ids, ids)] * 25, clock=cpu)))
    measured = run(body, ranks=1, transport="threads")[0]
    spec = ModelSpec.of_gpt("whole", WHOLE_GPT)
    free = Link(1e30, 0.0)
    hw = Hardware("parts", 1e12, 1e12, 1e12, intra=free, inter=free, chips_per_domain=1, kernels=k)
    return measured / predict(spec, Candidate(microbatch=WHOLE_ROWS), WHOLE_ROWS, hw).step


def python_costs() -> dict:
    """Seconds of Python (autograd, dispatch, small-array bookkeeping) in the forward + backward of
    one GPT block (`python_block`) and of the embedding + head + loss (`python_ends`): a GPT so small
    (width 8, 4 tokens) that its arithmetic is nothing, with 1 and with 3 blocks."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 8, (1, 4))
    t = {}
    for n in (1, 3):
        model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=n, n_head=2, d_model=8))
        t[n] = _median_time(lambda model=model: model.loss(ids, ids).backward(), 5, clock=cpu)
    block = max((t[3] - t[1]) / 2, 0.0)
    return {"python_block": block, "python_ends": max(t[1] - block, 0.0), **step_python(ids, t)}


def step_python(ids, fwd_bwd: dict) -> dict:
    """Seconds of Python a training step spends outside the model's forward + backward: per parameter
    tensor (`python_tensor`: AdamW, DDP's gradient buckets, zeroing) and once (`python_step`: the
    schedule's bookkeeping). `train_3d` on one thread rank of the same tiny GPTs as `python_costs`
    (17 and 41 tensors), less their forward + backward (`fwd_bwd`, by block count)."""
    rest = {}
    for n in (1, 3):
        cfg = GPTConfig(vocab_size=8, block_size=4, n_layer=n, n_head=2, d_model=8)

        def body(comm, cfg=cfg):  # (cpu: the rank's own thread)
            return float(np.median(step_seconds(comm, cfg, [(ids, ids)] * 15, clock=cpu, drop=2)))
        rest[n] = run(body, ranks=1, transport="threads")[0] - fwd_bwd[n]
    per_tensor = max((rest[3] - rest[1]) / (41 - 17), 0.0)
    return {"python_tensor": per_tensor, "python_step": max(rest[1] - 17 * per_tensor, 0.0)}


def fit_link(algorithm: str, p: int, sizes, times) -> tuple[float, float]:
    """(alpha, beta) of time = rounds x alpha + bytes sent x beta over the message sizes (bytes of
    float32), rounds and bytes as the planner counts them (``minidist.plan.traffic``), fitted in
    *relative* error (``estimates.fit_alpha_beta``): a 4 KB all-reduce's time counts as much as a
    4 MB one's, a thousand times longer, so alpha comes from the small messages it dominates, not
    from the noise of the large ones (chapter 11: what plain least squares read on a busy machine)."""
    rounds = [all_reduce_rounds(algorithm, n, p) for n in sizes]
    sent = [all_reduce_sent(algorithm, n, p) for n in sizes]
    return fit_alpha_beta(rounds, sent, times, relative=True)


def allreduce_alpha_beta(ranks: int = LINK_RANKS) -> tuple[float, float]:
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 22]

    def body(comm):
        out = []
        for nbytes in sizes:
            x = np.ones(nbytes // 4, np.float32)
            out.append(_median_time(lambda x=x: all_reduce(comm, x, algorithm="ring"), 7, min_time=0))
        return out
    times = np.array(run(body, ranks=ranks, transport="threads")).max(axis=0)
    return fit_link("ring", ranks, sizes, times)


def _work(minidist_ops: bool, batch: int = 8):
    """A unit of work: 40 plain 192x192 matmuls, or (`minidist_ops`) two forward + backward passes of a
    one-block minidist GPT (width 128, `batch` sequences of 64 tokens: every kind of op, at a lesson's
    sizes; small batches mean short kernels and many GIL hand-offs)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((192, 192)).astype(np.float32)
    model = GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=4, d_model=128))
    ids = rng.integers(0, 64, (batch, 64))

    def work():
        if not minidist_ops:
            for _ in range(40):
                a @ a
            return
        for _ in range(2):
            model.loss(ids, ids).backward()
    return work


def effective_cores(threads: int, minidist_ops: bool = False, batch: int = 8) -> float:
    """How many cores' worth of work `threads` threads really get at once: the same work (`_work`) on
    one thread (its CPU seconds: what it needs), then on `threads` threads together (wall time), in
    three turns. Plain matmuls (NumPy releases the GIL inside
    BLAS): the core count on an idle machine, less when other programs keep the cores busy.
    `minidist_ops=True`: minidist layers, whose Python (autograd, small ops) runs one thread at a
    time -- what ranks on the threads transport get. (MPI processes: `minidist.plan.calibrate_mpi`.)"""
    import threading

    work = _work(minidist_ops, batch)

    def together():
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    ratios = []
    for _ in range(3):  # alone and together in turns: a burst of other work spoils one pair, not the median
        ratios.append(threads * _median_time(work, 3, min_time=0, clock=cpu) /  # what it needs alone
                      _median_time(together, 3, min_time=0))
    # below 1 is possible: handing the GIL over costs time of its own
    return max(0.01, min(float(threads), float(np.median(ratios))))  # never nothing at all


def thread_counts(cores: int) -> list:
    """The cores' worth of minidist's thread ranks per rank count: one alone (the share of a core a
    single rank gets: 1 on a quiet machine, less when other programs want the cores too), as many
    as the CPUs, 2 x and 4 x as many, each with a fixed global batch of 16 rows split over them
    (16 / ranks rows each, so the more ranks, the thinner the kernels and the more GIL hand-offs per
    FLOP -- what a fixed batch over a bigger mesh does)."""
    return [{"ranks": n, "cores": effective_cores(n, minidist_ops=True, batch=max(1, 16 // n))}
            for n in (1, cores, 2 * cores, 4 * cores)]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def processes() -> list:
    """The mpirun probe (`minidist.plan.calibrate_mpi`): per process count, the cores' worth and all-reduce
    links n MPI processes get. [] without mpiexec or if the probe fails (said on stderr): the planner
    then prices MPI ranks with the free cores and the threads transport's link."""
    from minidist.plan.calibrate_mpi import probe_processes  # cycle: the probe times with _median_time, _work

    try:
        return probe_processes()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"calibrate: the mpirun probe failed ({e}); MPI step times will use the free cores",
              file=sys.stderr)
        return []


def calibrate(path: str = CALIBRATION_PATH) -> dict:
    try:
        from threadpoolctl import threadpool_limits
        limit = threadpool_limits(1)
    except ImportError:
        limit = None
    alpha, beta = allreduce_alpha_beta()
    cores = len(os.sched_getaffinity(0))
    threads = thread_counts(cores)
    c = {"cpu": cpu_name(), "cores": cores, "cores_free": effective_cores(cores),
         "flops": matmul_flops(),
         "mem_bandwidth": mem_bandwidth(), "op_overhead": op_overhead(), "alpha": alpha, "beta": beta,
         "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "time": time.time(),
         "kernels": kernels(), "load": os.getloadavg()[0]}
    # one rank's share of a core, measured at the start (thread_counts), the middle and the end of
    # the ~20 s: the median of the three, so a burst of someone else's work during one of them does
    # not price every lone rank (one calibration caught 0.25 of a core and predicted dp1 4x too slow)
    ones = [threads[0]["cores"], effective_cores(1, minidist_ops=True, batch=16)]
    c["processes"] = processes()
    ones.append(effective_cores(1, minidist_ops=True, batch=16))
    threads[0]["cores"] = float(np.median(ones))
    c.update(threads=threads, cores_threads=threads[1]["cores"], cores_threads_crowded=threads[-1]["cores"],
             load=(c["load"] + os.getloadavg()[0]) / 2)  # the load average at the middle and the end
    if limit is not None:
        limit.unregister() if hasattr(limit, "unregister") else None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:  # written whole, then renamed: a reader never sees half a file
        json.dump(c, f, indent=1)
    os.replace(tmp, path)
    return c


def main() -> None:
    c = calibrate()
    threads = ", ".join(f"{e['cores']:.1f} to {e['ranks']}" for e in c["threads"])
    print(f"{c['cpu']}, {c['cores']} cores ({c['cores_free']:.1f} free to processes; minidist's thread "
          f"ranks get {threads}; load average {c['load']:.1f}):")
    print(f"  matmul {c['flops'] / 1e9:.1f} GFLOP/s (one thread), memory "
          f"{c['mem_bandwidth'] / 1e9:.1f} GB/s, op overhead {c['op_overhead'] * 1e6:.1f} us, all-reduce "
          f"alpha {c['alpha'] * 1e6:.1f} us, beta {1 / c['beta'] / 1e9:.2f} GB/s")
    for e in c["processes"]:
        link = ", ".join(f"{a} alpha {by['fg'][0] * 1e6:.0f} us ({by['bg'][0] * 1e6:.0f} us on DDP's thread)"
                         for a, by in e["links"].items())
        print(f"  {e['ranks']} MPI processes: {e['cores']:.1f} cores' worth, +{e.get('python', 0):.2f} s "
              f"per s of Python; all-reduce {link}")
    print(f"wrote {CALIBRATION_PATH}")


if __name__ == "__main__":
    main()
