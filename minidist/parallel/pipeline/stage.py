"""`PipelineStage`: the layers of a `Sequential` that one pipeline rank holds, chunk by chunk.

The model is cut into per-virtual-stage layer ranges (`minidist.parallel.pipeline.partition`); the
schedule's placement (`minidist.parallel.pipeline.placement`) says which of them this rank holds.
Parameter names stay the full model's ("3.attn.qkv.weight"), so a stage's parameters compare
directly with the serial model's. Whatever wraps the layers (recomputation of each chunk, mixed
precision) is applied by the composition layer (`parallelize`) to `chunks`.
"""

from __future__ import annotations

from minidist.autograd import ops
from minidist.parallel.pipeline.placement import Placement, looped


class PipelineStage:
    """The layers of `model` (a Sequential) that pipeline stage `stage` of `num_stages` runs.

    `bounds` has one (start, end) range per virtual stage: num_stages of them, or num_stages * v for
    v chunks per stage; `placement` (default looped: chunk c of this stage is virtual stage
    c * num_stages + stage) must be the schedule's (`make_schedule(...).placement`).
    """

    def __init__(self, model, bounds, stage: int, num_stages: int, loss_fn=None,
                 placement: Placement | None = None):
        if len(bounds) % num_stages:
            raise ValueError(f"{len(bounds)} layer ranges do not split over {num_stages} stages")
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is not in 0..{num_stages - 1}")
        placement = placement or looped(num_stages, len(bounds) // num_stages)
        if placement.num_stages != num_stages:
            raise ValueError(f"placement {placement} is for {placement.num_stages} stages, not {num_stages}")
        layers = list(model)
        self.stage, self.num_stages, self.placement = stage, num_stages, placement
        self.num_chunks = placement.chunks
        self.num_virtual = placement.num_virtual
        self.layer_ids = [list(range(*b)) for b in placement.stage_bounds(bounds, stage)]
        self.chunks = [[layers[i] for i in ids] for ids in self.layer_ids]
        self.loss_fn = loss_fn or ops.cross_entropy

    def is_first(self, chunk: int) -> bool:
        return self.placement.virtual_stage(self.stage, chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.placement.virtual_stage(self.stage, chunk) == self.num_virtual - 1

    def forward(self, x, chunk: int = 0):
        for layer in self.chunks[chunk]:
            x = layer(x)
        return x

    def named_parameters(self):
        """(name in the full model, parameter), e.g. ("3.attn.qkv.weight", p)."""
        for ids, layers in zip(self.layer_ids, self.chunks):
            for i, layer in zip(ids, layers):
                for name, p in layer.named_parameters():
                    yield f"{i}.{name}", p

    def parameters(self) -> list:
        return [p for _, p in self.named_parameters()]

    def state_dict(self) -> dict:
        return {name: p.data for name, p in self.named_parameters()}
