"""A mesh of process groups: the world split along named axes dp x pp x cp x tp (and ep, carved from dp).

Rank order (tensor fastest, then context, then data, pipeline outermost, as in Megatron-LM)::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so the tp ranks of one layer shard are neighbours (on one host: the fastest links), then the cp
ranks that pass K/V round their ring, and each pipeline stage is a contiguous block of ranks.
**Expert parallelism** is carved from data parallelism: ``ep`` divides ``dp`` and each dp group is
cut into ep groups of consecutive dp ranks; ranks holding the same experts form ``edp`` (with the
cp ranks ``edp_cp``), which averages those experts' gradients; dense ones average over ``dp_cp``.
Example, 8 ranks as dp=2, pp=2, tp=2 -- ``mesh.draw()``::

    pp 0 | dp 0: 0 1 || dp 1: 2 3       tp groups {0,1} {2,3} {4,5} {6,7}
    pp 1 | dp 0: 4 5 || dp 1: 6 7       dp groups {0,2} {1,3} {4,6} {5,7}; pp groups {0,4} {1,5} ...

Chapter 14 walks through the 5D mesh (dp x pp x cp x tp, ep carved from dp).
"""

from __future__ import annotations

AXES = ("pp", "dp", "cp", "tp")  # outermost first


class Mesh:
    """``Mesh(comm, dp, pp, tp, cp=1, ep=1)``: ``.dp``, ``.pp``, ``.cp``, ``.tp``, ``.ep``, ``.edp``,
    ``.dp_cp``, ``.edp_cp`` sub-communicators, ``.dp_rank`` etc. and ``.group(name)``, ``.size(name)``."""

    def __init__(self, comm, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1):
        sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "ep": ep}
        for name, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"rank {comm.rank}: mesh size {name}={v!r} must be a positive integer")
        total = dp * pp * cp * tp
        if total != comm.size:
            shown = " x ".join(f"{k}={v}" for k, v in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp))
                               if k != "cp" or cp > 1)
            raise ValueError(f"rank {comm.rank}: mesh {shown} = {total} ranks, but the world has "
                             f"{comm.size}; choose sizes whose product is {comm.size}")
        if dp % ep:
            raise ValueError(f"rank {comm.rank}: ep={ep} is carved from dp={dp} and must divide it; use ep "
                             f"in {[d for d in range(1, dp + 1) if dp % d == 0]}")
        every = comm.allgather_obj((dp, pp, tp, cp, ep))  # every rank must build the same mesh
        if any(s != every[0] for s in every):
            listed = ", ".join(f"rank {r}: dp={d} pp={q} tp={t}"
                               + ("" if (c, e) == (1, 1) else f" cp={c} ep={e}")
                               for r, (d, q, t, c, e) in enumerate(every))
            raise ValueError(f"rank {comm.rank}: the ranks build meshes of different sizes ({listed}); "
                             f"every rank must pass the same dp, pp and tp (and cp, ep)")
        self.world = comm
        self.dp_size, self.pp_size, self.cp_size, self.tp_size, self.ep_size = dp, pp, cp, tp, ep
        self.coords = self.coords_of(comm.rank)
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = (self.coords[a] for a in AXES)
        self.ep_rank, self.edp_rank = self.dp_rank % ep, self.dp_rank // ep
        self.tp = self._split(("tp",))
        self.dp = self._split(("dp",))
        self.pp = self._split(("pp",))
        self.cp = self._split(("cp",))
        self.dp_cp = self._split(("dp", "cp"))
        # ep: consecutive dp ranks; edp: the dp ranks with my ep_rank
        self.ep = comm.split(self._color(("dp",)) * (dp // ep) + self.edp_rank, self.ep_rank)
        self.edp = comm.split(self._color(("dp",)) * ep + self.ep_rank, self.edp_rank)
        # the ranks holding the same experts, over dp and cp: they average those experts' gradients
        self.edp_cp = comm.split(self._color(("dp", "cp")) * ep + self.ep_rank,
                                 self.edp_rank * cp + self.cp_rank)

    def size(self, axis: str) -> int:
        return getattr(self, f"{axis}_size")

    def group(self, axis: str):
        """The sub-communicator of ``axis`` ('dp', 'pp', 'cp', 'tp', 'ep', 'edp', 'dp_cp' or 'edp_cp')."""
        return getattr(self, axis)

    def coords_of(self, rank: int) -> dict:
        """{'pp': .., 'dp': .., 'cp': .., 'tp': ..} of a world rank (inverse of ``rank_of``)."""
        out = {}
        for a in reversed(AXES):
            out[a], rank = rank % self.size(a), rank // self.size(a)
        return {a: out[a] for a in AXES}

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        """World rank at these coordinates."""
        return ((pp_rank * self.dp_size + dp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank

    def _color(self, axes) -> int:
        """The flattened coordinates along every axis not in ``axes``: one value per group."""
        color = 0
        for a in AXES:
            if a not in axes:
                color = color * self.size(a) + self.coords[a]
        return color

    def _split(self, axes):
        key = 0
        for a in AXES:
            if a in axes:
                key = key * self.size(a) + self.coords[a]
        return self.world.split(self._color(axes), key)

    def draw(self) -> str:
        """Every world rank at its place: one line per pipeline stage, dp blocks of cp x tp ranks."""
        lines = []
        for pp in range(self.pp_size):
            cells = []
            for dp in range(self.dp_size):
                ranks = " ".join(" ".join(str(self.rank_of(pp, dp, tp, cp)) for tp in range(self.tp_size))
                                 + (" |" if self.cp_size > 1 and cp < self.cp_size - 1 else "")
                                 for cp in range(self.cp_size))
                tag = f"dp {dp}" + (f" (ep {dp % self.ep_size})" if self.ep_size > 1 else "")
                cells.append(f"{tag}: {ranks}")
            lines.append(f"pp {pp} | " + " || ".join(cells))
        head = (f"mesh dp={self.dp_size} x pp={self.pp_size} x cp={self.cp_size} x tp={self.tp_size}"
                f" (ep={self.ep_size} from dp); within a dp block: cp groups of tp ranks, '|' between")
        return "\n".join([head, *lines])

    def __repr__(self):
        return (f"<Mesh dp={self.dp_size} pp={self.pp_size} cp={self.cp_size} tp={self.tp_size} "
                f"ep={self.ep_size}: rank {self.world.rank} = (pp {self.pp_rank}, dp {self.dp_rank}, "
                f"cp {self.cp_rank}, tp {self.tp_rank})>")
