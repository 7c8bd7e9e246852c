"""`run_schedule`: one pipeline rank executes its instruction list on its `PipelineStage`.

It walks the list from `schedule.py` (or any schedule) and does exactly what each instruction says:
Forward / Backward (traced as "Forward" / "Backward", category "compute", with mb and chunk), the
split backward's B and W (`split_backward.py`), point-to-point sends of activations and their
gradients (the receiver learns shape and dtype from the transport's header; sends complete in the
background, receives block; a message between two chunks of this rank, the turn of a V, is handed
over locally), `SendRecv` (all parts posted at once) and `OptimizerStep` (a callback: DP all-reduce
+ update). Each forward's saved activations are counted as `minidist.nn.footprint` counts them.

Loss and gradients: the last virtual stage computes `loss_fn(output, target)` per microbatch and
back-propagates `w_mb * loss`. The default `w_mb = 1/m` makes the accumulated gradients those of the
mean loss over the batch when every microbatch counts the same number of tokens; with ignored
targets (-1) a microbatch's loss is a mean over fewer tokens, so the caller passes
`loss_weights[mb] = n_mb / N` (its share of the batch's valid tokens) to get the token mean.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from minidist.accel.backend import to_host
from minidist.autograd.tensor import Tensor
from minidist.nn.footprint import MemoryAccountant
from minidist.parallel.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvAct,
    SendAct,
    SendGrad,
    SendRecv,
    message_key,
    peer_of,
)
from minidist.parallel.pipeline.split_backward import backward_input
from minidist.parallel.pipeline.stage import PipelineStage
from minidist.trace.spans import span


def run_schedule(stage: PipelineStage, comm, instructions, inputs=None, targets=None,
                 optimizer_step=None, ddp=None, loss_weights=None) -> StepStats:
    """Execute one training step's `instructions` (this stage's list) on `stage`.

    `comm` is the pipeline group (its rank is the stage index). `inputs[mb]` feed the first virtual
    stage, `targets[mb]` the loss on the last one; other ranks may pass None. Parameter gradients
    accumulate over the microbatches into `p.grad` (the mean-loss gradient); `optimizer_step()` is
    called at `OptimizerStep`. `ddp`: a `DistributedDataParallel` wrapping this stage over its
    data-parallel group: every backward but each chunk's last runs in `ddp.no_sync()`, so the
    gradient buckets' all-reduces start during the last one (`optimizer_step` must call
    `ddp.wait_gradients()`). `loss_weights[mb]` multiplies microbatch mb's loss before its backward
    (default 1/m each; see the module docstring). Returns this stage's `StepStats`, whose `loss` is
    the weighted sum (default: the mean microbatch loss).
    """
    if comm.size != stage.num_stages:
        raise ValueError(f"rank {comm.rank}: pipeline group has {comm.size} ranks but the model is cut into "
                         f"{stage.num_stages} stages")
    if any(stage.is_first(c) for c in range(stage.num_chunks)) and inputs is None:
        raise ValueError(f"rank {comm.rank}: stage {stage.stage} holds the first layers and needs inputs")
    if any(stage.is_last(c) for c in range(stage.num_chunks)) and targets is None:
        raise ValueError(f"rank {comm.rank}: stage {stage.stage} computes the loss and needs targets")
    if loss_weights is not None and targets is not None and len(loss_weights) != len(targets):
        raise ValueError(f"rank {comm.rank}: {len(loss_weights)} loss_weights for {len(targets)} "
                         "microbatches; give one weight per microbatch")
    chunks = {getattr(i, "chunk", 0) for instr in instructions for i in getattr(instr, "ops", (instr,))}
    if max(chunks, default=0) >= stage.num_chunks:
        raise ValueError(f"rank {comm.rank}: the instructions use chunk {max(chunks)} but this stage holds "
                         f"{stage.num_chunks} ({stage.placement}); build it with the schedule's placement: "
                         "PipelineStage(..., placement=make_schedule(...).placement)")
    last_backward = {}
    for instr in instructions:
        if isinstance(instr, (Backward, BackwardWeight)):  # what completes a microbatch's gradients
            last_backward[instr.chunk] = instr.mb
    rt = _Runtime(stage, comm, inputs, targets, optimizer_step, ddp, last_backward, loss_weights)
    t0 = time.perf_counter()
    for instr in instructions:
        rt.execute(instr)
    rt.finish_sends()
    rt.stats.seconds = time.perf_counter() - t0
    if rt.losses:  # read back once the step is done: on JAX a read per microbatch stalls the dispatch
        rt.stats.loss = rt.own_loss() + rt.mirror_loss
    return rt.stats


def split_microbatches(batch, num_microbatches: int, rank: int = 0) -> list:
    """Cut a batch along axis 0 into m equal microbatches; a clear error if it does not divide."""
    n = batch.shape[0]
    if not isinstance(num_microbatches, int) or num_microbatches < 1 or n % num_microbatches:
        raise ValueError(f"rank {rank}: a batch of {n} rows does not split into {num_microbatches} equal "
                         f"microbatches; use a number of microbatches that divides {n}, "
                         f"or a batch size that is a multiple of {num_microbatches}")
    size = n // num_microbatches
    return [batch[i * size:(i + 1) * size] for i in range(num_microbatches)]


@dataclass
class StepStats:
    """What one stage measured in one `run_schedule` call."""
    loss: float | None = None                  # sum of w_mb * microbatch loss (last virtual stage only)
    activation_bytes: dict = field(default_factory=dict)  # (mb, chunk) -> bytes its forward saved
    peak_activation_bytes: int = 0             # most activation bytes held at once (MemoryAccountant)
    peak_microbatches: int = 0                 # most (mb, chunk) held from F to B at once (M_B)
    peak_fb_bytes: int = 0                     # most bytes of the (mb, chunk)s held from F to B
    peak_weight_queue_bytes: int = 0           # most bytes kept from B to W (M_W; split backward only)
    peak_pending_weights: int = 0              # most (mb, chunk) between B and W at once
    seconds: float = 0.0


def _tag(instr, stage: int, placement, num_virtual: int) -> int:
    """A tag both ends compute alike: unique per (kind, mb, receiving virtual stage)."""
    kind, mb, _, dst = message_key(instr, stage, placement)
    return 2 * (mb * num_virtual + dst) + (kind == "grad")


class _Done:
    """A request that is already complete: a local hand-off between two chunks of one rank."""

    def __init__(self, value):
        self.value = value

    def test(self) -> bool:
        return True

    def wait(self):
        return self.value


class _Runtime:
    """The state of one stage while it executes one step's instruction list."""

    def __init__(self, stage: PipelineStage, comm, inputs, targets, optimizer_step, ddp=None,
                 last_backward=None, loss_weights=None):
        self.stage, self.comm = stage, comm
        self.inputs, self.targets, self.optimizer_step = inputs, targets, optimizer_step
        self.ddp, self.last_backward = ddp, last_backward or {}
        if targets is not None and loss_weights is None:  # only the loss stage needs them
            loss_weights = [1.0 / len(targets)] * len(targets)
        self.loss_weights = loss_weights
        self.x, self.out, self.received, self.to_send = {}, {}, {}, {}
        self.stats, self.losses = StepStats(), []
        # activations are counted as `minidist.nn.footprint` counts them: arrays saved for backward, each
        # buffer once, the stage's parameters left out, released when backward frees them
        self.acct = MemoryAccountant()
        self.sends = []  # requests of sends still in flight
        self.local = {}  # message key -> array handed from one chunk of this rank to another
        self.wq = {}  # (mb, chunk) -> the WeightGradQueue its BackwardInput left for BackwardWeight
        self.mirror_loss = 0.0  # two model copies: the other end's share of the loss

    def forward(self, mb: int, chunk: int) -> None:
        st, key = self.stage, (mb, chunk)
        if st.is_first(chunk):
            x = self.inputs[mb]
        else:
            x = Tensor(self.received.pop(("act",) + key), requires_grad=True)
        before = self.acct.activation_bytes
        with span("Forward", "compute", mb=mb, chunk=chunk), \
                self.acct.track_activations(model=st, reset_peak=False):
            out = st.forward(x, chunk)
            if st.is_last(chunk):
                loss = st.loss_fn(out, self.targets[mb])
                self.losses.append((loss.data, self.loss_weights[mb]))  # read after the step
                out = loss * self.loss_weights[mb]
        self.x[key], self.out[key] = x, out
        self.stats.activation_bytes[key] = self.acct.activation_bytes - before
        self.stats.peak_microbatches = max(self.stats.peak_microbatches, len(self.x))
        held = sum(self.stats.activation_bytes[k] for k in self.x)
        self.stats.peak_fb_bytes = max(self.stats.peak_fb_bytes, held)
        self.stats.peak_activation_bytes = self.acct.peak_activation_bytes
        if not st.is_last(chunk):
            self.to_send[("act",) + key] = out.data

    def backward(self, mb: int, chunk: int) -> None:
        st, key = self.stage, (mb, chunk)
        x, out = self.x.pop(key), self.out.pop(key)
        # data parallelism: only a chunk's last backward completes its gradients, so only then may
        # their bucketed all-reduces start (overlapping the rest of the backward pass)
        sync = self.ddp is None or self.last_backward.get(chunk) == mb
        with span("Backward", "compute", mb=mb, chunk=chunk), \
                (nullcontext() if sync else self.ddp.no_sync()):
            if st.is_last(chunk):
                out.backward()
            else:
                out.backward(self.received.pop(("grad",) + key))
        if not st.is_first(chunk):
            self.to_send[("grad",) + key] = x.grad

    def backward_input(self, mb: int, chunk: int) -> None:
        """B: the input's gradient (sent on at once); the weights' part waits in a queue for W."""
        st, key = self.stage, (mb, chunk)
        x, out = self.x.pop(key), self.out.pop(key)
        seed = None if st.is_last(chunk) else self.received.pop(("grad",) + key)
        with span("BackwardInput", "compute", mb=mb, chunk=chunk):
            self.wq[key] = backward_input(out, seed, inputs=[x] if isinstance(x, Tensor) else [])
        held = sum(q.nbytes() for q in self.wq.values())
        self.stats.peak_weight_queue_bytes = max(self.stats.peak_weight_queue_bytes, held)
        self.stats.peak_pending_weights = max(self.stats.peak_pending_weights, len(self.wq))
        if not st.is_first(chunk):
            self.to_send[("grad",) + key] = x.grad

    def backward_weight(self, mb: int, chunk: int) -> None:
        """W: the weight gradients B put off; data parallelism syncs on each chunk's last one."""
        sync = self.ddp is None or self.last_backward.get(chunk) == mb
        with span("BackwardWeight", "compute", mb=mb, chunk=chunk), \
                (nullcontext() if sync else self.ddp.no_sync()):
            self.wq.pop((mb, chunk)).run()

    def post(self, instr):
        """Start one send or receive; returns (request, where to store a received array or None).
        A message to this rank itself (a V's turn) is handed over in `self.local`, no transport."""
        st = self.stage
        peer = peer_of(instr, st.stage, st.placement)
        tag = _tag(instr, st.stage, st.placement, st.num_virtual)
        if isinstance(instr, (SendAct, SendGrad)):
            kind = "act" if isinstance(instr, SendAct) else "grad"
            data = self.to_send.pop((kind, instr.mb, instr.chunk))
            if peer == st.stage:
                self.local[message_key(instr, st.stage, st.placement)] = data
                return _Done(None), None
            return self.comm.isend(data, peer, tag), None
        kind = "act" if isinstance(instr, RecvAct) else "grad"
        if peer == st.stage:
            data = self.local.pop(message_key(instr, st.stage, st.placement))
            return _Done(data), (kind, instr.mb, instr.chunk)
        return self.comm.irecv(peer, tag), (kind, instr.mb, instr.chunk)

    def communicate(self, parts) -> None:
        """Post every part, then wait for the receives (a single one, or all of a SendRecv's).

        Sends are not waited for here: they complete in the background (`finish_sends`). A schedule
        that cannot deadlock with blocking sends cannot deadlock with these either -- they only
        remove waits -- and a stage does not stall until its neighbour is ready to receive.
        """
        names = "+".join(type(p).__name__ for p in parts)
        cat = "send" if all(isinstance(p, (SendAct, SendGrad)) for p in parts) else "recv"
        sends_first = sorted(parts, key=lambda p: not isinstance(p, (SendAct, SendGrad)))  # local hand-offs
        posted = [self.post(p) for p in sends_first]
        self.sends = [r for r in self.sends if not r.test()] + [req for req, where in posted if where is None]
        with span(names, cat, mb=min(p.mb for p in parts)):
            for req, where in posted:
                if where is not None:
                    self.received[where] = req.wait()

    def finish_sends(self) -> None:
        """Wait until every send of this step has been received (before the update and at the end)."""
        if self.sends:
            with span("WaitSends", "wait"):
                for req in self.sends:
                    req.wait()
            self.sends = []

    def own_loss(self) -> float:
        return float(np.sum([float(to_host(v)) * w for v, w in self.losses]))

    def sum_copies(self) -> None:
        """Two model copies (a dual placement): rank s's chunk 0 is the piece the mirror rank p-1-s holds
        as chunk 1, and the other way round. Each gradient becomes both copies' sum (a + b here, b + a
        there: equal), the loss both ends' shares. After the replicas' sums (DDP): the order is free."""
        if self.ddp is not None:
            self.ddp.wait_gradients()
        st = self.stage
        link, mirror = self.comm.channel("dual-copies"), st.num_stages - 1 - st.stage
        params = [[p for layer in chunk for p in layer.parameters()] for chunk in st.chunks]
        zeros = [[p.grad if p.grad is not None else p.data * 0 for p in ps] for ps in params]
        xp = params[0][0].backend.xp
        mine = [xp.concatenate([g.ravel() for g in gs]) for gs in zeros]
        theirs = [link.sendrecv(x, mirror, mirror, tag, tag) for tag, x in
                  enumerate([*mine, np.array([self.own_loss() if self.losses else 0.0])])]
        for c, ps in enumerate(params):
            flat, at = theirs[1 - c], 0
            for p, g in zip(ps, zeros[c]):
                p.grad = g + flat[at:at + g.size].reshape(g.shape)
                at += g.size
        self.mirror_loss = float(to_host(theirs[2])[0])

    def execute(self, instr) -> None:
        if isinstance(instr, Forward):
            self.forward(instr.mb, instr.chunk)
        elif isinstance(instr, Backward):
            self.backward(instr.mb, instr.chunk)
        elif isinstance(instr, BackwardInput):
            self.backward_input(instr.mb, instr.chunk)
        elif isinstance(instr, BackwardWeight):
            self.backward_weight(instr.mb, instr.chunk)
        elif isinstance(instr, SendRecv):
            self.communicate(instr.ops)
        elif isinstance(instr, OptimizerStep):
            self.finish_sends()
            if self.stage.placement.copies == 2:
                self.sum_copies()
            if self.optimizer_step is not None:
                with span("OptimizerStep", "step"):
                    self.optimizer_step()
        else:
            self.communicate((instr,))
