"""Expert parallelism: the E experts of an MoE block split over an ``ep`` group, tokens moved by all-to-all.

Rank r holds experts r·E/ep .. (r+1)·E/ep - 1 and its own tokens (ep is carved from dp). It routes
them itself (router replicated, capacity C from its own tokens), fills its E x C buffer
(``minidist.nn.moe``), and then (1) a **dispatch all-to-all** sends the rows for rank j's experts
to rank j, (2) its experts run on every rank's rows for them, (3) a **combine all-to-all** sends
each block back, where it is gated and added exactly as the serial block does. Backward is the same
two all-to-alls in reverse. ``ExpertParallelMoE`` equals the serial ``MoE`` on each rank's tokens
(uneven tokens too: each rank its own capacity). Bytes: :func:`all_to_all_bytes`.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of, to_host
from minidist.autograd import ops
from minidist.autograd.tensor import Function
from minidist.comm import all_to_all
from minidist.nn.module import ModuleList
from minidist.nn.moe import MoE, run_local_experts


class AllToAll(Function):
    """x (p·m, ...) -> y: block j of y is rank j's block [my rank] of x; backward: the same exchange.
    ``sizes``: x's blocks' rows when not p equal blocks (uneven tokens); ``received`` (a list) gets
    the rows each rank sent, when they were not all equal."""

    @staticmethod
    def forward(ctx, x, comm, sizes=None, received=None):
        got = []
        ctx.comm, ctx.got = comm, got
        y = _exchange(comm, x, sizes, got)
        if received is not None:
            received[:] = got
        return y

    @staticmethod
    def backward(ctx, g):  # what came in goes back out, in the blocks it came in
        return _exchange(ctx.comm, g, ctx.got or None), None


def _exchange(comm, x, sizes=None, received=None):
    """Block j of x's rows (p equal blocks, or blocks of ``sizes`` rows) to rank j, rank j's block for
    me in its place; unequal blocks that came in are concatenated, their rows added to ``received``.
    Through the host once each way (``all_to_all`` stages there anyway: on JAX no per-block program)."""
    host = to_host(x)
    if sizes is not None:
        blocks = np.split(host, np.cumsum(sizes)[:-1])
    elif host.shape[0] % comm.size:
        raise ValueError(f"rank {comm.rank}: the expert exchange cuts its {host.shape[0]} rows into "
                         f"{comm.size} equal blocks, one per rank: need a multiple of {comm.size} rows")
    else:
        blocks = list(host.reshape(comm.size, host.shape[0] // comm.size, *host.shape[1:]))
    got = all_to_all(comm, blocks)
    if all(b.shape == got[0].shape for b in got):
        out = np.stack(got).reshape(-1, *host.shape[1:])
    else:  # uneven tokens: each rank's capacity, so its blocks, its own
        out = np.concatenate(got)
        if received is not None:
            received.extend(len(b) for b in got)
    be = backend_of(x)  # back in x's library, on this rank's own device if the rank has one
    return (comm.backend if comm.backend.name == be.name else be).from_host(out)


class ExpertParallelMoE(MoE):
    """``MoE`` with its experts split over ``ep_comm``: the same weights as ``MoE(..., rng=same seed)``
    (every rank draws all of them, in the serial order, and keeps its own)."""

    def __init__(self, dim, n_experts, ep_comm, k=1, capacity_factor=1.25, hidden=None, **kw):
        if n_experts % ep_comm.size:
            ok = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
            raise ValueError(f"rank {ep_comm.rank}: n_experts={n_experts} is not divisible by the expert-"
                             f"parallel size ep={ep_comm.size}; use ep in {ok}")
        super().__init__(dim, n_experts, k, capacity_factor, hidden, **kw)
        local = n_experts // ep_comm.size
        first = ep_comm.rank * local
        object.__setattr__(self, "ep", ep_comm)
        object.__setattr__(self, "local_experts", local)
        object.__setattr__(self, "first_expert", first)
        self.experts = ModuleList(list(self.experts)[first:first + local])

    def run_experts(self, buf, cap):
        """Buffer (E·C, d) -> its outputs (E·C, d): rank j's rows to rank j, my E/ep experts on every
        sender's rows (ep blocks of (E/ep)·C rows), the outputs back to where they came from."""
        rows = []  # filled when the ranks' capacities differ (uneven tokens): rows each rank sent
        sent = AllToAll.apply(buf, comm=self.ep, received=rows)      # block j: rank j's rows for me
        if not rows:  # every rank's capacity is mine: one call on all the blocks
            out = run_local_experts(self.experts, sent, self.ep.size, cap)
            return AllToAll.apply(out, comm=self.ep)                 # to where they came from
        starts = np.cumsum([0, *rows])
        out = ops.concat([run_local_experts(self.experts, sent[a:b], 1, (b - a) // self.local_experts)
                          for a, b in zip(starts[:-1], starts[1:])])  # sender j's block: its capacity C_j
        return AllToAll.apply(out, comm=self.ep, sizes=rows)

    def global_name(self, name: str) -> str:
        """A local parameter name -> the serial MoE's (``experts.0.`` -> ``experts.{first}.``)."""
        if name.startswith("experts."):
            i, rest = name[len("experts."):].split(".", 1)
            return f"experts.{int(i) + self.first_expert}.{rest}"
        return name


def all_to_all_bytes(n_experts: int, ep: int, cap: int, dim: int, itemsize: int) -> dict:
    """Bytes one rank sends per MoE layer: each all-to-all sends ep-1 blocks of (E/ep)·C·d elements."""
    one = (ep - 1) * (n_experts // ep) * cap * dim * itemsize
    return {"forward": 2 * one, "backward": 2 * one}
