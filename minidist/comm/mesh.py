"""A mesh of process groups: the world split into data (dp), pipeline (pp) and tensor (tp) groups.

Rank order (tensor fastest, pipeline outermost, as in Megatron-LM)::

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so the tp ranks of one layer shard are neighbours (on one host: the fastest links), and each
pipeline stage is a contiguous block of dp*tp ranks. Example, 8 ranks as dp=2, pp=2, tp=2:
tp groups {0,1} {2,3} {4,5} {6,7}; dp groups {0,2} {1,3} {4,6} {5,7}; pp groups {0,4} {1,5} ...
"""

from __future__ import annotations


class Mesh:
    """``Mesh(comm, dp, pp, tp)``: ``.dp``, ``.pp``, ``.tp`` sub-communicators, ``.dp_rank`` etc."""

    def __init__(self, comm, dp: int = 1, pp: int = 1, tp: int = 1):
        for name, v in (("dp", dp), ("pp", pp), ("tp", tp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"rank {comm.rank}: mesh size {name}={v!r} must be a positive integer")
        if dp * pp * tp != comm.size:
            raise ValueError(f"rank {comm.rank}: mesh dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp} ranks, "
                             f"but the world has {comm.size}; choose sizes whose product is {comm.size}")
        sizes = comm.allgather_obj((dp, pp, tp))  # every rank must build the same mesh
        if any(s != sizes[0] for s in sizes):
            listed = ", ".join(f"rank {r}: dp={d} pp={q} tp={t}" for r, (d, q, t) in enumerate(sizes))
            raise ValueError(f"rank {comm.rank}: the ranks build meshes of different sizes ({listed}); "
                             f"every rank must pass the same dp, pp and tp")
        self.world, self.dp_size, self.pp_size, self.tp_size = comm, dp, pp, tp
        r = comm.rank
        self.tp_rank, self.dp_rank, self.pp_rank = r % tp, (r // tp) % dp, r // (tp * dp)
        self.tp = comm.split(self.pp_rank * dp + self.dp_rank, self.tp_rank)
        self.dp = comm.split(self.pp_rank * tp + self.tp_rank, self.dp_rank)
        self.pp = comm.split(self.dp_rank * tp + self.tp_rank, self.pp_rank)

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """World rank at these coordinates."""
        return (pp_rank * self.dp_size + dp_rank) * self.tp_size + tp_rank

    def __repr__(self):
        return (f"<Mesh dp={self.dp_size} pp={self.pp_size} tp={self.tp_size}: rank {self.world.rank} = "
                f"(pp {self.pp_rank}, dp {self.dp_rank}, tp {self.tp_rank})>")
