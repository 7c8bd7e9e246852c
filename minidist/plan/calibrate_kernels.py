"""What minidist's own kernels and Python cost on this machine (`kernels`), in one thread's CPU seconds.

The planner's compute model for the "minidist" engine is a sum of these: linear FLOP/s, seconds per
element of GELU, layer norm, a plain elementwise op, per attention score, per cross-entropy logit and
per AdamW parameter, the Python of a block, of the embedding + head and of a training step per
parameter tensor (`python_costs`), times `cold` (a whole step over the sum of its parts,
`cold_factor`). Plus the matmul peak, memory bandwidth and the fixed cost of one tiny op.
"""

from __future__ import annotations

import time

import numpy as np

from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.comm import run
from minidist.nn import GPT, GPTConfig
from minidist.nn.optim import AdamW
from minidist.parallel.three_d import train_3d
from minidist.plan.clock import _median_time, cpu
from minidist.plan.hardware import Hardware, Link
from minidist.plan.mesh import Candidate
from minidist.plan.model import ModelSpec
from minidist.plan.steptime import predict


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
    return measured / predict(spec, Candidate(microbatch_size=WHOLE_ROWS), WHOLE_ROWS, hw).step


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

