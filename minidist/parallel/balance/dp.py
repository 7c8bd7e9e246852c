"""Data parallelism whose per-rank shares of the global batch follow measured throughput.

    run = train_dp_balanced(comm, cfg, batches, slow=Slowdown("rank=2,factor=3,from_step=5"))

Per step, on every rank: take rows [off_r, off_r + n_r) of the global batch (``shares.offsets``),
compute loss and backward (inside ``slow.compute``: the emulated slowdown), ``ddp.backward(loss,
n_samples=tokens_r)`` so the gradient is the whole batch's whatever the n_r, wait for the gradient
all-reduce (the *wait* time: the fast ranks idle here while a straggler computes), take the
optimizer step, then ``StepMonitor.record`` (one tiny all-gather) gives every rank the same table of
compute, wait, rows, loss sum and tokens. From it: the global loss, the straggler detector, and the
``ShareBalancer``'s decision -- identical on every rank, so no rank ever disagrees about the shares.

The backward runs in ``ddp.no_sync()``, so the gradient all-reduce starts in ``wait_gradients``,
after the (emulated) compute: a slowed device's gradients are late, as on real hardware, and the
others' lateness shows as *wait* (DDP's usual overlap would start buckets during the real backward,
before the emulated extra time).

``plan(step)`` (tests) replaces the balancer: the shares of each step come from it, e.g. random
vectors, to prove training equals the serial twin whatever the shares.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from minidist.accel.backend import bucket, compiles_per_shape
from minidist.nn import GPT
from minidist.nn.optim import make_optimizer
from minidist.parallel.balance.measure import StepMonitor, StragglerDetector
from minidist.parallel.balance.shares import ShareBalancer, balanced_time, offsets
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.trace.spans import current, now, span


def pad_rows(x, y, rows: int):
    """(x, y) padded to ``rows`` rows: token 0 in, ignored targets (-1) out. The loss averages over
    the targets that are not ignored, so the loss and gradients are those of (x, y); on JAX (a
    program per shape) a share of any size then runs at one of a few power-of-two shapes, not a
    new program set every time the shares move."""
    pad = rows - x.shape[0]
    if pad <= 0:
        return x, y
    return (np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]),
            np.concatenate([y, np.full((pad, *y.shape[1:]), -1, y.dtype)]))


@dataclass
class BalancedRun:
    """What ``train_dp_balanced`` returns on every rank (the same on all, but ``model``)."""
    model: object
    losses: list = field(default_factory=list)        # per step: the global batch's mean loss
    step_seconds: list = field(default_factory=list)  # per step: seconds on this rank's clock (trace.clock)
    shares: list = field(default_factory=list)        # per step: the rows each rank took
    ideal_seconds: list = field(default_factory=list)  # per step: B / Σ s_i from the smoothed speeds
    stragglers: list = field(default_factory=list)    # per step: ranks named slow
    monitor: StepMonitor | None = None
    detector: StragglerDetector | None = None


def train_dp_balanced(comm, cfg, batches, lr: float = 0.1, optimizer: str = "sgd", slow=None,
                      balance: bool = True, every: int = 2, window: int = 3, margin: float = 0.1,
                      threshold: float = 0.5, patience: int = 2, plan=None, on_step=None) -> BalancedRun:
    """Train ``GPT(cfg)`` on ``batches`` (global (x, y), the same list on every rank) with moving shares.

    ``slow``: a ``Slowdown`` emulating slow ranks (None: nothing slowed). ``balance=False`` keeps equal
    shares (the static baseline, still measured). ``on_step(step, run, table)`` after each step."""
    if slow is not None:
        slow.check_world(comm.size, rank=comm.rank)
    total = int(batches[0][0].shape[0])
    model = GPT(cfg)
    ddp = DistributedDataParallel(model, comm)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    balancer = ShareBalancer(total, comm.size, every=every, margin=margin)
    monitor = StepMonitor(comm, window=window, extra=("loss_sum", "tokens"))
    run = BalancedRun(model=model, monitor=monitor, detector=StragglerDetector(threshold, patience))
    for step, (x, y) in enumerate(batches):
        shares = plan(step) if plan is not None else balancer.shares
        if sum(shares) != x.shape[0] or len(shares) != comm.size or min(shares) < 1:
            raise ValueError(f"rank {comm.rank}: step {step}: shares {shares} must be {comm.size} counts >= 1"
                             f" summing to the global batch of {x.shape[0]} rows")
        lo = offsets(shares)[comm.rank]
        xs, ys = x[lo:lo + shares[comm.rank]], y[lo:lo + shares[comm.rank]]
        tokens = int((np.asarray(ys) != -1).sum())
        if compiles_per_shape(model.parameters()[0].backend):
            xs, ys = pad_rows(xs, ys, bucket(len(xs), total))
        computed = len(xs)  # the rows the step's time covers (padded ones too): the balancer's per-row cost
        t0 = now()
        emulated = nullcontext() if slow is None else slow.compute(comm.rank, step, shares[comm.rank])
        with span("Compute", "compute", step=step, rows=shares[comm.rank]), emulated, ddp.no_sync():
            loss = model.loss(xs, ys)
            ddp.backward(loss, n_samples=tokens)
        t1 = now()
        with span("Wait", "wait", step=step):
            ddp.wait_gradients()
        t2 = now()
        opt.step()
        opt.zero_grad()
        table = monitor.record(t1 - t0, t2 - t1, computed, float(loss.item()) * tokens, tokens)
        run.losses.append(float(table[:, 3].sum() / max(table[:, 4].sum(), 1)))
        run.shares.append(list(shares))
        run.step_seconds.append(now() - t0)
        spr = monitor.seconds_per_row()
        run.ideal_seconds.append(balanced_time(total, spr))
        run.stragglers.append(run.detector.update(step, spr))
        warm = step >= window  # the window no longer holds step 0 (its warm-up time is not a speed)
        if balance and plan is None and warm and balancer.decide(step, spr) and current() is not None:
            current().instant("Rebalance", "step", shares=list(balancer.shares))
        if on_step is not None:
            on_step(step, run, table)
    return run
