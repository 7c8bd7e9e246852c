"""Back-of-the-envelope estimates: the cost model every lesson prints beside what it measures.

Chapter 0 (lessons/00-estimates.md) derives each formula; the lessons call these to print
"predicted vs measured" for their main step. Hardware constants live in ``minidist.plan.hardware``
(datasheets, with sources); this machine's own are measured once by ``python -m minidist.calibrate``
and read back by :func:`machine`.

* **compute** -- training a dense transformer of N parameters on D tokens costs ``6·N·D`` FLOPs
  (2 per parameter per token forward, 4 backward); :func:`mfu` is the share of the peak reached;
  :func:`peak_flops` picks a chip's FP8 peak for FP8 matmuls (twice bf16's on H100 and B200).
* **memory** -- :func:`training_memory`: bytes per parameter for parameters, gradients and
  optimizer state in fp32 or mixed precision, divided by the ZeRO stage's sharding; activations
  per layer from :func:`activation_bytes_per_layer` (Korthikanti et al. 2022).
* **roofline** -- an op is compute-bound when its arithmetic intensity (FLOPs per byte moved)
  exceeds the machine's FLOP/s ÷ bytes/s; :func:`matmul_intensity`, :func:`decode_intensity`,
  :func:`roofline_time`.
* **communication** -- the alpha-beta model: ``time = rounds·alpha + bytes_sent·beta``;
  :func:`fit_alpha_beta` fits alpha and beta from timed runs (least squares), :func:`ring_time`.
"""

from __future__ import annotations

import numpy as np

from minidist.plan.hardware import PRESETS, here
from minidist.plan.mesh import Candidate, Settings
from minidist.plan.model import ModelSpec
from minidist.plan.roofline_plot import plot_roofline
from minidist.plan.steptime import predict

# -- compute ---------------------------------------------------------------------------------------


def training_flops(n_params: float, n_tokens: float) -> float:
    """6·N·D: forward 2 FLOPs per parameter per token (a multiply and an add), backward 4 (the
    gradient w.r.t. the input and w.r.t. the weight, 2 each). Attention's T² term is left out."""
    return 6.0 * n_params * n_tokens


def mfu(n_params: float, tokens_per_step: float, step_seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the 6·N·D FLOPs a step must do, per second, over the peak."""
    return training_flops(n_params, tokens_per_step) / step_seconds / peak_flops


def peak_flops(hw, dtype: str = "bf16") -> float:
    """A chip's dense peak for matmuls in ``dtype``: ``hw.fp8_flops`` for "fp8" (an error if the
    chip lists none), else ``hw.peak_flops`` (bf16)."""
    if dtype != "fp8":
        return hw.peak_flops
    if not hw.fp8_flops:
        raise ValueError(f"{hw.name} lists no FP8 peak (hardware.py); use dtype='bf16' or an H100/B200")
    return hw.fp8_flops


def fp8_all_reduce_bytes(n: int, p: int) -> float:
    """Bytes one rank sends in the FP8 all-reduce hook of n gradients (``compress/fp8.py``): 1-byte
    codes plus a 4-byte scale per chunk, in an all-to-all and an all-gather: 2(p-1)(n/p + 4)."""
    return 2 * (p - 1) * (n / p + 4) if p > 1 else 0.0


# -- memory ----------------------------------------------------------------------------------------

# bytes per parameter: (parameters, gradients, optimizer state) with Adam (two moments)
BYTES_PER_PARAM = {
    "fp32": (4, 4, 8),    # fp32 weights and grads; Adam's m and v in fp32
    "mixed": (2, 2, 12),  # bf16/fp16 weights and grads; fp32 master weights + m + v (ZeRO paper's K=12)
    "fp8": (4, 4, 8),     # FP8 Linears (parallel/memory/fp8.py): the fp32 weights are the masters
}


def training_memory(n_params: float, precision: str = "mixed", zero_stage: int = 0, dp: int = 1) -> dict:
    """Bytes per rank of parameters, gradients and optimizer state (no activations).

    ZeRO-1 shards the optimizer state over the dp ranks, ZeRO-2 the gradients too, ZeRO-3 the
    parameters too: mixed precision is 16 bytes/param unsharded, 2 + 2 + 12/dp at stage 1,
    2 + 14/dp at stage 2, 16/dp at stage 3 (Rajbhandari et al. 2020, Fig. 1)."""
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision={precision!r}: choose one of {sorted(BYTES_PER_PARAM)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}: 0 (plain data parallel), 1, 2 or 3")
    p, g, o = BYTES_PER_PARAM[precision]
    shard = [1, 1, 1]
    for i in range(zero_stage):  # stage 1 shards o, stage 2 also g, stage 3 also p
        shard[2 - i] = dp
    return {"params": n_params * p / shard[0], "grads": n_params * g / shard[1],
            "optimizer": n_params * o / shard[2],
            "total": n_params * (p / shard[0] + g / shard[1] + o / shard[2])}


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, itemsize: int = 2,
                               tp: int = 1, recompute: str = "none") -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2;
    the paper's 34·s·b·h + 5·a·s²·b is for 2-byte activations and 1-byte dropout masks).
    ``recompute``: "none", "selective" (the a·s² attention terms recomputed) or "full" (only the
    layer input kept). ``tp`` divides everything (with sequence parallelism)."""
    s, b, h, a = seq, batch, hidden, heads
    scale = itemsize / 2
    if recompute == "full":
        return 2 * s * b * h * scale / tp
    linear = 34 * s * b * h * scale
    attention = 0 if recompute == "selective" else 5 * a * s * s * b * scale
    return (linear + attention) / tp


# -- roofline --------------------------------------------------------------------------------------

def matmul_intensity(m: int, k: int, n: int, itemsize: int = 2) -> float:
    """FLOPs per byte of (m, k) @ (k, n): 2mkn over reading both inputs and writing the output.
    For square n x n it is n/3 per byte at 2 bytes: large matmuls are compute-bound."""
    return 2.0 * m * k * n / (itemsize * (m * k + k * n + m * n))


def decode_intensity(batch: int, itemsize: int = 2) -> float:
    """FLOPs per byte of one decode step: 2·P·B FLOPs over reading the P weights once (the KV cache
    ignored) -- B/itemsize: at batch 1, 0.5 FLOP per byte, so decoding is memory-bound."""
    return 2.0 * batch / itemsize


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """FLOPs per byte above which an op is compute-bound (the roofline's knee)."""
    return peak_flops / bandwidth


def roofline_time(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> tuple[float, str]:
    """(seconds, "compute" or "memory"): the larger of flops/peak and bytes/bandwidth."""
    tc, tm = flops / peak_flops, nbytes / bandwidth
    return (tc, "compute") if tc >= tm else (tm, "memory")


# -- communication ---------------------------------------------------------------------------------

def fit_alpha_beta(rounds, bytes_sent, seconds, relative: bool = False) -> tuple[float, float]:
    """Least-squares alpha (s per round) and beta (s per byte) of ``t = rounds·alpha + bytes·beta``
    over timed runs; both kept >= a tiny positive floor (a noisy fit can go negative).
    ``relative=True`` minimises the relative errors instead: small messages count as much as big ones."""
    a = np.stack([np.asarray(rounds, float), np.asarray(bytes_sent, float)], axis=1)
    t = np.asarray(seconds, float)
    w = 1.0 / t if relative else np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    return max(float(alpha), 1e-9), max(float(beta), 1e-15)


def ring_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-reduce: 2(p-1) rounds, 2(p-1)/p·N bytes sent per rank."""
    return 0.0 if p == 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


# -- this machine ----------------------------------------------------------------------------------

def machine(transport: str = "threads"):
    """This machine's measured constants (``minidist.plan.hardware.here``), or None if
    ``python -m minidist.calibrate`` has not run yet."""
    try:
        return here(transport=transport)
    except (FileNotFoundError, KeyError, ValueError):
        return None


def step_prediction(n_layer: int, d_model: int, n_head: int, vocab: int, seq: int, batch: int, *, dp: int = 1,
                    pp: int = 1, tp: int = 1, microbatches: int = 1, schedule: str = "1f1b", chunks: int = 1,
                    dtype_bytes: int = 4, optimizer: str = "adamw", transport: str = "threads",
                    checkpoint: str = "none"):
    """Seconds the planner (``minidist.plan``, chapter 11) predicts for one training step of a
    minidist GPT on THIS machine's calibrated constants, or None before ``python -m minidist.calibrate``.
    ``batch`` is the global batch in sequences; ``checkpoint``: "none", "selective" or "full"."""
    hw = machine(transport)
    if hw is None:
        return None
    model = ModelSpec("lesson", n_layer=n_layer, d_model=d_model, n_head=n_head, vocab=vocab, seq=seq,
                      engine="minidist", dtype_bytes=dtype_bytes)
    cand = Candidate(dp=dp, tp=tp, pp=pp, microbatch_size=max(batch // (dp * microbatches), 1),
                     schedule=schedule, chunks=chunks, checkpoint=checkpoint)
    return predict(model, cand, batch, hw, Settings(optimizer)).step


def predicted_vs_measured(what: str, predicted: float, measured: float) -> str:
    """One line: ``what: predicted 1.20 ms, measured 1.50 ms (measured/predicted 1.25x)``;
    ``predicted`` None: say how to get a prediction."""
    if predicted is None:
        return f"{what}: measured {measured * 1e3:.2f} ms (`python -m minidist.calibrate` gives a prediction)"
    ratio = measured / predicted if predicted > 0 else float("nan")
    return f"{what}: predicted {predicted * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms ({ratio:.2f}x)"


# -- `python -m minidist.plan.estimates`: the tables of chapter 0 -----------------------------------------

def hardware_table() -> list[str]:
    """One line per preset of ``minidist.plan.hardware``: compute, HBM, links, the ridge point."""
    rows = [f"{'system':<15} {'TFLOP/s':>7} {'HBM GB':>6} {'TB/s':>5} {'ridge':>5}  "
            f"{'fast domain GB/s':<27} {'network GB/s':<30} {'host/disk GB/s':>14}"]
    for hw in PRESETS.values():
        host = f"{hw.host_link.bandwidth / 1e9:.0f}" if hw.host_link else "-"
        disk = f"{hw.disk.bandwidth / 1e9:.1f}" if hw.disk else "-"
        fast = f"{hw.intra.bandwidth / 1e9:.0f} {hw.intra.name}"
        net = f"{hw.inter.bandwidth / 1e9:.1f} {hw.inter.name}"
        rows.append(f"{hw.name:<15} {hw.peak_flops / 1e12:>7.0f} {hw.hbm_bytes / 1e9:>6.0f} "
                    f"{hw.hbm_bandwidth / 1e12:>5.2f} {ridge_point(hw.peak_flops, hw.hbm_bandwidth):>5.0f}  "
                    f"{fast:<27} {net:<30} {host + ' / ' + disk:>14}")
    return rows


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m minidist.plan.estimates",
                                     description="The tables of chapter 0, and this machine's constants.")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the roofline of every preset (chapter 0)")
    args = parser.parse_args(argv)
    print("hardware (minidist/plan/hardware.py; per chip, bf16 dense, links each way; sources in its "
          "docstring;")
    print("ridge = FLOP/s / HBM bytes/s: FLOPs per byte above which an op is compute-bound):")
    print("\n".join(hardware_table()))
    mine = machine()
    if mine is None:
        print("\nthis machine: not calibrated yet -- run `python -m minidist.calibrate` (~20 s, cached)")
    else:
        ridge = ridge_point(mine.peak_flops, mine.hbm_bandwidth)
        print(f"\nthis machine ({mine.name}, calibrated): matmul {mine.peak_flops / 1e9:.1f} GFLOP/s, "
              f"memory {mine.hbm_bandwidth / 1e9:.1f} GB/s (ridge {ridge:.1f}),\n  all-reduce alpha "
              f"{mine.intra.latency * 1e6:.0f} us, beta {1e9 / mine.intra.bandwidth:.2f} ns/byte")
    psi, tokens = 7e9, 2e12
    days = training_flops(psi, tokens) / (1024 * 989e12 * 0.4) / 86400
    print(f"\nworked example: a 7B model on 2T tokens needs 6·N·D = {training_flops(psi, tokens):.2e} FLOPs: "
          f"{days:.1f} days on 1024 H100s at 40% MFU")
    for stage in range(4):
        m = training_memory(psi, "mixed", stage, dp=64)
        print(f"  mixed precision + Adam, ZeRO-{stage} over 64 ranks: {m['total'] / 1e9:6.1f} GB per rank "
              f"(params {m['params'] / 1e9:.1f}, grads {m['grads'] / 1e9:.1f}, "
              f"optimizer {m['optimizer'] / 1e9:.1f})")
    act = activation_bytes_per_layer(4096, 1, 4096, 32)
    sel = activation_bytes_per_layer(4096, 1, 4096, 32, recompute="selective")
    print(f"  activations per layer, seq 4096, micro-batch 1, h 4096, 32 heads, bf16: {act / 1e9:.2f} GB "
          f"(selective recompute: {sel / 1e9:.2f} GB)")
    h100 = PRESETS["h100"]
    print(f"  FP8 matmuls on an H100: {peak_flops(h100, 'fp8') / 1e12:.0f} TFLOP/s dense, "
          f"{peak_flops(h100, 'fp8') / peak_flops(h100):.0f}x bf16; its gradients all-reduced in FP8 over 64 "
          f"ranks: {fp8_all_reduce_bytes(psi, 64) / 1e9:.1f} GB sent per rank (bf16 ring "
          f"{2 * 63 / 64 * 2 * psi / 1e9:.1f} GB)")
    print(f"  roofline on an H100 (ridge {ridge_point(989e12, 3.35e12):.0f}): a 4096^3 bf16 matmul does "
          f"{matmul_intensity(4096, 4096, 4096):.0f} FLOP/byte (compute-bound);\n  a decode step "
          f"{decode_intensity(1):.0f} at batch 1 and {decode_intensity(256):.0f} at batch 256 (memory-bound)")
    if args.plot:
        examples = [("4096³ matmul", matmul_intensity(4096, 4096, 4096)),
                    ("decode, batch 1", decode_intensity(1)), ("decode, batch 256", decode_intensity(256))]
        plot_roofline(args.plot, PRESETS, examples, mine)
        print(f"\nroofline drawn to {args.plot}")


if __name__ == "__main__":
    main()
