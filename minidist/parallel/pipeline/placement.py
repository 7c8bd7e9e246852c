"""Where the model's pieces live: which (rank, chunk) holds each virtual stage, declared once.

A model cut into `p * v` contiguous pieces (virtual stages 0 .. p*v-1, in model order) is spread
over `p` pipeline ranks, `v` chunks each. Three shapes are used:

* **looped** (Megatron's interleaved 1F1B; v = 1 is plain GPipe/1F1B): chunk c of rank s is
  virtual stage `c*p + s`. Activations go round the ranks v times; the last rank's chunk c feeds
  rank 0's chunk c+1.
* **V** (ZB-V, DualPipeV; v = 2): rank s holds virtual stages `s` and `2p-1-s`. Activations go down
  the ranks and back up: rank p-1 holds both p-1 and p (its hand-off at the turn is local) and
  rank 0 holds the first AND the last virtual stage, so the loss is computed where the data came in.
  Each rank's two chunks are one early and one late piece, so its memory is balanced like 1F1B's.
* **dual** (full DualPipe; p even): TWO copies of a model cut into p pieces, one per direction.
  Chunk 0 of rank s is copy 0's piece s (its microbatches enter at rank 0), chunk 1 is copy 1's
  piece p-1-s (they enter at rank p-1): each piece lives on ranks s and p-1-s, whose gradients the
  runtime sums. A message stays in its copy: its peer is `rank_of(vs, chunk)`.

Every consumer asks the same `Placement`: `PipelineStage` (which layer ranges a rank holds),
`message_key` / `peer_of` (who a send goes to), the simulator and validator, and the runtime.
A schedule carries its placement (`Schedule.placement`); plain lists of lists are looped.
"""

from __future__ import annotations

from dataclasses import dataclass

SHAPES = ("looped", "v", "dual")


@dataclass(frozen=True)
class Placement:
    """`num_stages` ranks x `chunks` chunks each, in `shape` "looped" (c*p + s), "v" (s, 2p-1-s) or
    "dual" (s of copy 0, p-1-s of copy 1)."""
    num_stages: int
    chunks: int = 1
    shape: str = "looped"

    def __post_init__(self):
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"placement num_stages must be an int >= 1, got {self.num_stages!r}")
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"placement chunks must be an int >= 1, got {self.chunks!r}")
        if self.shape not in SHAPES:
            raise ValueError(f"placement shape {self.shape!r}: use one of {SHAPES}")
        if self.shape in ("v", "dual") and self.chunks != 2:
            raise ValueError(f"a {self.shape} placement has exactly 2 chunks per rank, got {self.chunks}")
        if self.shape == "dual" and self.num_stages % 2:
            raise ValueError(f"a dual placement (two model copies) needs an even number of ranks, got "
                             f"{self.num_stages}")

    @property
    def num_virtual(self) -> int:
        """Pieces of the model: p x chunks (a dual placement: p, each held twice)."""
        return self.num_stages * (1 if self.shape == "dual" else self.chunks)

    @property
    def copies(self) -> int:
        """Copies of the model's parameters over the ranks: 2 for dual, else 1."""
        return 2 if self.shape == "dual" else 1

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """The model piece chunk `chunk` of rank `stage` holds."""
        p = self.num_stages
        if self.shape != "looped":
            return stage if chunk == 0 else self.num_virtual - 1 - stage
        return chunk * p + stage

    def owner(self, vs: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage `vs` -- the inverse of `virtual_stage` (dual: copy 0's)."""
        p = self.num_stages
        if not 0 <= vs < self.num_virtual:
            raise ValueError(f"no virtual stage {vs}: there are {self.num_virtual} "
                             f"(0..{self.num_virtual - 1})")
        if self.shape == "v":
            return (vs, 0) if vs < p else (2 * p - 1 - vs, 1)
        return (vs, 0) if self.shape == "dual" else (vs % p, vs // p)

    def rank_of(self, vs: int, chunk: int = 0) -> int:
        """The rank holding virtual stage `vs` (looped: vs mod p, also past the last chunk; dual: in
        copy `chunk`, the chunk of the message's own end)."""
        if self.shape == "dual":
            return vs if chunk == 0 else self.num_stages - 1 - vs
        return vs % self.num_stages if self.shape == "looped" else self.owner(vs)[0]

    def stage_bounds(self, bounds, stage: int) -> list:
        """The layer ranges rank `stage` holds, chunk by chunk, from the model's per-virtual-stage cut."""
        if len(bounds) != self.num_virtual:
            raise ValueError(f"{len(bounds)} layer ranges for a placement of {self.num_stages} ranks x "
                             f"{self.chunks} chunks; cut the model into {self.num_virtual} pieces "
                             f"(partition_uniform(n_layers, {self.num_virtual}))")
        return [bounds[self.virtual_stage(stage, c)] for c in range(self.chunks)]


def looped(num_stages: int, chunks: int = 1) -> Placement:
    return Placement(num_stages, chunks, "looped")


def v_shape(num_stages: int) -> Placement:
    return Placement(num_stages, 2, "v")


def dual(num_stages: int) -> Placement:
    return Placement(num_stages, 2, "dual")


class Schedule(list):
    """A schedule (`schedule[stage]` = that stage's instruction list) that knows its `placement`, and
    whether it is designed for sends that complete in the background (`buffered_sends`, as the
    runtime's isends do) rather than strict rendezvous: the V schedules deadlock under rendezvous,
    ZB-H2 runs but waits (51 steps instead of 27 at p = 4, m = 8). The simulator uses it by default."""

    def __init__(self, lists, placement: Placement, buffered_sends: bool = False):
        super().__init__(lists)
        self.buffered_sends = buffered_sends
        if len(self) != placement.num_stages:
            raise ValueError(f"{len(self)} instruction lists for a placement of {placement.num_stages} ranks")
        self.placement = placement


def placement_of(schedule) -> Placement:
    """A schedule's declared placement; a plain list of lists is looped with as many chunks as it uses."""
    declared = getattr(schedule, "placement", None)
    if declared is not None:
        return declared
    chunks = [getattr(i, "chunk", 0) for ops in schedule for i in ops]
    chunks += [x.chunk for ops in schedule for i in ops for x in getattr(i, "ops", ())]
    return looped(len(schedule), 1 + max(chunks, default=0))
