"""Helpers shared by the data-parallel tests: the tiny GPT, its batches, the serial twin, row splits."""

import contextlib

import numpy as np

from minidist.nn import GPT, GPTConfig, optim

TOL = 1e-10


CFG = GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, d_model=8, dtype="float64")


def data(counts, steps, accum, seed=0, ignore=0.0):
    """Per step, a global batch: rank r's rows are a contiguous block of counts[r] rows. A share
    ``ignore`` of the targets is -1 (ignored by the loss: its mean runs over the valid tokens)."""
    rng = np.random.default_rng(seed)
    n = sum(counts)
    out = []
    for _ in range(steps):
        x, y = rng.integers(0, CFG.vocab_size, (n, 5)), rng.integers(0, CFG.vocab_size, (n, 5))
        out.append((x, np.where(rng.random(y.shape) < ignore, -1, y)))
    return out


def make_opt(name, params, lr=1e-2):
    """AdamW, or plain SGD: AdamW is (nearly) invariant to the gradient's scale, so a gradient that
    is p times too large barely moves its result; SGD moves p times further."""
    return optim.AdamW(params, lr=lr) if name == "adamw" else optim.SGD(params, lr=lr)


def serial_gpt(batches, lr=1e-2, opt="adamw"):
    m = GPT(CFG)
    opt = make_opt(opt, m.parameters(), lr)
    for x, y in batches:
        opt.zero_grad()
        m.loss(x, y).backward()
        opt.step()
    return {k: np.array(v) for k, v in m.state_dict().items()}


def my_rows(counts, rank):
    lo = sum(counts[:rank])
    return slice(lo, lo + counts[rank])


def accumulate(ddp, loss_fn, x, y, accum, sync_last=True, tokens=False):
    """``accum`` micro-steps over this rank's rows, the last one syncing (with ``sync_last=False``
    all run in ``no_sync()``: ``wait_gradients`` communicates everything). Weighted by rows, or by
    valid target tokens (``tokens``: what a per-token mean with ignored targets averages over)."""
    parts = [ix for ix in np.array_split(np.arange(len(x)), accum)]
    for i, ix in enumerate(parts):
        with ddp.no_sync() if i < accum - 1 or not sync_last else contextlib.nullcontext():
            n = int((y[ix] != -1).sum()) if tokens else len(ix)
            if len(ix):
                xi, yi = x[ix], y[ix]
            else:  # a rank (or micro-step) with no samples still joins the sync: any row, weight n = 0
                xi = yi = np.zeros((1, x.shape[1]), x.dtype)
            ddp.backward(loss_fn(xi, yi), n_samples=n)


def uneven_counts(p, accum, extra) -> list[int]:
    """Rows per rank: accum + extra, at least 0 (a rank may get no samples), at least one row in all."""
    counts = [max(0, accum + e) for e in extra[:p]]
    return counts if sum(counts) else [1] + counts[1:]
