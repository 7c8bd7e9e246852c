"""Expert parallelism: the E experts of an MoE block split over an ``ep`` group, tokens moved by all-to-all.

Each of the ep ranks holds E/ep experts (rank r: experts r·E/ep .. (r+1)·E/ep - 1) and its own
tokens (ep is carved from dp, ``minidist.comm.Mesh``). It routes them itself (router replicated,
capacity C from its own N tokens), fills its E x C dispatch buffer (``minidist.nn.moe``), and then:

1. **dispatch all-to-all** -- the buffer's rows for rank j's experts (E/ep · C rows) go to rank j;
2. its experts run on ep·C rows each (every rank's tokens for that expert);
3. **combine all-to-all** -- each block goes back to the rank it came from, which gates and adds
   the rows to its tokens exactly as the serial block does.

Backward is the same two all-to-alls in reverse (an all-to-all is its own transpose); bytes per
layer: :func:`all_to_all_bytes`. ``ExpertParallelMoE`` equals the serial ``MoE`` applied to each
rank's tokens separately; ranks may hold different numbers of tokens (each its own capacity: the
all-to-all carries each block's shape). ``model.py`` makes every block of a GPT such a block.
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
    """x (p·m, ...) -> y: block j (m rows) of y is rank j's block [my rank] of x; backward: the same
    exchange. Ranks whose capacities differ (uneven tokens) send blocks of their own sizes: ``sizes``
    cuts x into blocks of those rows (None: p equal blocks), and ``received`` (a list) is filled
    with the rows each rank sent, when they were not all equal."""

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
    """Block j of x's rows (its first axis cut in comm.size equal blocks, or in blocks of ``sizes``
    rows) to rank j, and rank j's block for me in its place. ``all_to_all`` stages its chunks
    through the host anyway, so a device array is copied out once, sent as host views of its
    blocks, and copied back once (on JAX: no eager slice per block and no reshape or stack
    programs); a NumPy array's copies are no-ops. Blocks that came in with different row counts
    are concatenated and their counts appended to ``received``."""
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
