"""Placement: which rank and chunk hold each virtual stage; peers and layer ranges follow from it alone."""

import pytest

from minidist.nn import GPT, GPTConfig
from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.partition import format_partition, partition_uniform
from minidist.parallel.pipeline.placement import Placement, Schedule, looped, placement_of, v_shape
from minidist.parallel.pipeline.runtime import run_schedule
from minidist.parallel.pipeline.schedule import Forward, RecvAct, RecvGrad, SendAct, SendGrad, peer_of
from minidist.parallel.pipeline.stage import PipelineStage


def test_v_table_by_hand():
    """p = 4: rank s holds pieces s and 7 - s (ZB-V's figure): rank 0 the first and the last."""
    v = v_shape(4)
    table = {s: [v.virtual_stage(s, c) for c in (0, 1)] for s in range(4)}
    assert table == {0: [0, 7], 1: [1, 6], 2: [2, 5], 3: [3, 4]}
    want = [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    assert [v.owner(vs) for vs in range(8)] == want
    assert v.num_virtual == 8


def test_looped_table_by_hand():
    lp = looped(4, 2)
    assert [[lp.virtual_stage(s, c) for c in (0, 1)] for s in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [lp.owner(vs) for vs in (0, 3, 4, 7)] == [(0, 0), (3, 0), (0, 1), (3, 1)]


def test_v_peers_go_down_then_back_up():
    """Chunk 0 sends down (s -> s+1), chunk 1 sends up (s -> s-1); rank p-1 hands piece p-1 to itself."""
    v = v_shape(4)
    assert [peer_of(SendAct(0, 0), s, v) for s in range(4)] == [1, 2, 3, 3]
    assert [peer_of(SendAct(0, 1), s, v) for s in range(1, 4)] == [0, 1, 2]
    assert [peer_of(RecvAct(0, 1), s, v) for s in range(4)] == [1, 2, 3, 3]
    assert [peer_of(SendGrad(0, 1), s, v) for s in range(4)] == [1, 2, 3, 3]
    assert [peer_of(RecvGrad(0, 0), s, v) for s in range(3)] == [1, 2, 3]
    assert peer_of(RecvGrad(0, 0), 3, v) == 3  # piece 4's gradient, from its own chunk 1


def test_stage_holds_the_placements_layer_ranges():
    """A GPT of 6 layers (embed, 4 blocks, head) in 4 pieces on 2 ranks: rank 0 gets pieces 0 and 3."""
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=4, n_head=2, d_model=8))
    bounds = partition_uniform(len(model), 4)  # [(0, 2), (2, 4), (4, 5), (5, 6)]
    st = PipelineStage(model, bounds, 0, 2, placement=v_shape(2))
    assert st.layer_ids == [[0, 1], [5]]
    assert st.is_first(0) and st.is_last(1) and not st.is_last(0)
    st1 = PipelineStage(model, bounds, 1, 2, placement=v_shape(2))
    assert st1.layer_ids == [[2, 3], [4]] and not any(st1.is_last(c) or st1.is_first(c) for c in (0, 1))
    assert PipelineStage(model, bounds, 0, 2).layer_ids == [[0, 1], [4]]  # default: looped


def test_bad_placements_are_refused_clearly():
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        Placement(4, 3, "v")
    with pytest.raises(ValueError, match="shape 'w'"):
        Placement(4, 2, "w")
    with pytest.raises(ValueError, match="no virtual stage 8: there are 8"):
        v_shape(4).owner(8)
    with pytest.raises(ValueError, match=r"cut the model into 4 pieces \(partition_uniform"):
        v_shape(2).stage_bounds([(0, 1), (1, 2)], 0)
    with pytest.raises(ValueError, match="3 instruction lists for a placement of 2 ranks"):
        Schedule([[], [], []], v_shape(2))


def test_a_plain_list_is_looped_with_its_chunks():
    assert placement_of([[Forward(0, 1)], [Forward(0, 0)]]) == looped(2, 2)
    assert placement_of(Schedule([[], []], v_shape(2))) == v_shape(2)


def test_a_v_schedule_on_a_one_chunk_stage_is_refused():
    """The schedule's chunks must be the stage's: a ZB-V list on a stage cut without its placement."""
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, d_model=8))
    stage = PipelineStage(model, partition_uniform(len(model), 2), 0, 2)

    class Two:
        rank, size = 0, 2
    with pytest.raises(ValueError, match="use chunk 1 but this stage holds 1 .*placement=make_schedule"):
        run_schedule(stage, Two(), make_schedule("zb-v", 2, 2)[0], [None] * 2, [None] * 2)


def test_format_partition_names_pieces_and_their_ranks():
    text = format_partition([(0, 2), (2, 4), (4, 5), (5, 6)], placement=v_shape(2))
    assert text.splitlines() == ["piece 0 (rank 0 chunk 0): layers 0..1 (2 layers)",
                                 "piece 1 (rank 1 chunk 0): layers 2..3 (2 layers)",
                                 "piece 2 (rank 1 chunk 1): layers 4..4 (1 layer)",
                                 "piece 3 (rank 0 chunk 1): layers 5..5 (1 layer)"]
    assert format_partition([(0, 3)], placement=looped(1)) == "stage 0: layers 0..2 (3 layers)"
