"""Which layers each pipeline stage (and each of its model chunks) holds, as the planner counts them.

minidist's GPT is a list of layers -- embedding, n blocks, head -- cut by `partition_uniform` like
`train_3d` cuts it; a Megatron-style model splits its blocks evenly over the virtual stages, the
embedding joining the first and the head the last. Chunk c of stage s is virtual stage c·pp + s.
"""

from __future__ import annotations

import functools

from minidist.parallel.pipeline.partition import partition_uniform


def layer_kinds(model) -> list[str]:
    return ["embed"] + ["block"] * model.n_layer + ["head"]


def stage_layers(model, cand) -> list[list[int]]:
    """For each pipeline stage, the indices (into `layer_kinds`) of the layers it holds (all chunks).

    minidist: `partition_uniform` of its whole layer list (embedding and head count as layers), what
    `train_3d` does. Megatron-LM: the blocks split evenly over the virtual stages, the embedding
    joining the first and the head the last (a 1T GPT's 128 blocks on 64 stages: 2 each)."""
    return _stage_layers(model.n_layer, cand.pp, cand.chunks, model.engine == "minidist")


def chunk_layers(model, cand) -> list[list[list[int]]]:
    """[stage][chunk] -> layer indices: chunk c of stage s is virtual stage c·pp + s."""
    return _chunk_layers(model.n_layer, cand.pp, cand.chunks, model.engine == "minidist")


@functools.lru_cache(maxsize=256)
def _stage_layers(n_layer: int, pp: int, chunks: int, whole_list: bool) -> list[list[int]]:
    return [[i for chunk in stage for i in chunk] for stage in _chunk_layers(n_layer, pp, chunks, whole_list)]


@functools.lru_cache(maxsize=256)
def _chunk_layers(n_layer: int, pp: int, chunks: int, whole_list: bool) -> list[list[list[int]]]:
    if whole_list:
        bounds = partition_uniform(n_layer + 2, pp * chunks)
    else:
        blocks = [(a + 1, b + 1) for a, b in partition_uniform(n_layer, pp * chunks)]  # layer 0 = embed
        bounds = [(0 if v == 0 else a, n_layer + 2 if v == len(blocks) - 1 else b)
                  for v, (a, b) in enumerate(blocks)]
    return [[list(range(*bounds[c * pp + s])) for c in range(chunks)] for s in range(pp)]
