"""The planner's model terms one at a time, each against the formula written out here (Korthikanti et
al. 2022, Table 2; Narayanan et al. 2021, section 4.1), not against end-to-end totals that several terms
could mask: activation bytes per layer for every tp, sequence parallelism on/off and recompute policy;
pipeline sends per tp and cp."""

import pytest

from minidist.plan.mesh import Candidate
from minidist.plan.model import ModelSpec
from minidist.plan.traffic import collectives

# a GPT-3-like layer: h = 1024, a = 16 heads, s = 512, b = 2, bf16 (Megatron's engine)
H, A, S, B = 1024, 16, 512, 2
SPEC = ModelSpec("t", n_layer=4, d_model=H, n_head=A, vocab=1000, seq=S)


def korthikanti(tp, sp, policy, s=S, b=B, h=H, a=A):
    """Bytes one layer keeps (bf16), Table 2: without SP 10·sbh replicated + 24·sbh/t + 5·a·s²·b/t;
    with SP everything / t; selective drops 5·a·s²·b; full keeps only the 2·sbh input (/t with SP)."""
    sbh = s * b * h
    if policy == "full":
        return 2 * sbh / (tp if sp else 1)
    scores = 0 if policy == "selective" else 5 * a * s * s * b
    if sp:
        return (34 * sbh + scores) / tp
    return 10 * sbh + (24 * sbh + scores) / tp


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [True, False])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_activation_bytes_per_layer_are_table_2(tp, sp, policy):
    got = SPEC.layer_activation_bytes(0, B, tp=tp, policy=policy, sequence_parallel=sp)
    assert got == pytest.approx(korthikanti(tp, sp, policy), rel=1e-12)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_context_parallel_splits_the_sequence_of_every_term(cp):
    got = SPEC.layer_activation_bytes(0, B, tp=2, cp=cp, policy="none", sequence_parallel=True)
    assert got == pytest.approx(korthikanti(2, True, "none", s=S // cp), rel=1e-12)


def test_flash_attention_keeps_no_scores_and_gqa_shrinks_k_and_v():
    flash = SPEC.replace(flash_attention=True)
    assert flash.layer_activation_bytes(0, B, tp=2) == pytest.approx(korthikanti(2, True, "selective"))
    # k and v are 2·sbh each of Table 2's 24·sbh split part: with kv_heads = a/4 they are a quarter
    gqa = SPEC.replace(kv_heads=A // 4)
    sbh = S * B * H
    want = korthikanti(2, True, "none") - (4 * sbh - 4 * sbh / 4) / 2
    assert gqa.layer_activation_bytes(0, B, tp=2) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("tp,cp,pp,chunks", [(1, 1, 2, 1), (2, 1, 2, 1), (4, 1, 4, 1), (2, 2, 2, 1),
                                            (2, 1, 2, 2)])
def test_pipeline_sends_are_one_tp_slice_of_the_activation(tp, cp, pp, chunks):
    """Megatron scatters the b·(s/cp)·h activation over tp before the send and gathers it after: each tp
    rank sends 1/tp of it, m times per chunk boundary it has (Narayanan et al. 2021, 4.1)."""
    m, mb = 4, 1
    cand = Candidate(tp=tp, cp=cp, pp=pp, microbatch_size=mb, chunks=chunks,
                     schedule="interleaved" if chunks > 1 else "1f1b")
    act = mb * (S // cp) * H * 2 / tp
    for stage in range(pp):
        calls = {c.name: c for c in collectives(SPEC.replace(n_layer=pp * chunks * 2), cand, m * mb, stage)
                 if c.axis == "pp"}
        virtual = [c * pp + stage for c in range(chunks)]
        sends = sum(v < pp * chunks - 1 for v in virtual)
        recvs = sum(v > 0 for v in virtual)
        if sends:
            assert (calls["send_activation"].sent, calls["send_activation"].count) == (act, m * sends)
        if recvs:
            assert (calls["send_gradient"].sent, calls["send_gradient"].count) == (act, m * recvs)
        assert ("send_activation" in calls) == bool(sends) and ("send_gradient" in calls) == bool(recvs)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_allgather_traffic_is_k_and_v_gathered_and_their_gradients_reduce_scattered(cp):
    """Megatron's context parallelism (tp = 1), per layer-microbatch: the all-gather of K and V builds
    the whole sequence's 2·b·s·h bytes (bf16: x2), of which each rank sends (cp-1)/cp; the
    reduce-scatter of their gradients sends as much. Written out for h = 1024, s = 512, b = 2."""
    from minidist.plan.traffic import cp_attention_calls

    cand = Candidate(cp=cp, microbatch_size=B)
    whole = 2 * B * S * H * 2
    calls = cp_attention_calls(SPEC, cand, 3, "allgather")
    assert [(c.name, c.phase, c.count) for c in calls] == [("all_gather", "forward", 3),
                                                           ("reduce_scatter", "backward", 3)]
    for c in calls:
        assert c.payload == whole and c.sent == whole * (cp - 1) / cp


@pytest.mark.parametrize("mode", ["allgather", "ring"])
@pytest.mark.parametrize("tp,kv_heads,local", [(2, 16, 8), (4, 16, 4), (4, 4, 1), (8, 4, 1), (1, 4, 4)])
def test_cp_traffic_moves_only_this_tp_ranks_k_and_v_heads(mode, tp, kv_heads, local):
    """Under tensor parallelism a rank holds kv_heads / tp K/V heads (one, replicated, when tp exceeds
    them), and context parallelism moves only those: bytes = 2·b·s/cp·local·head_dim·2, by hand."""
    from minidist.plan.traffic import cp_attention_calls

    cp, hd = 2, H // A
    spec = SPEC.replace(kv_heads=kv_heads)
    own = 2 * B * (S // cp) * local * hd * 2  # this rank's K and V of its own tokens, bf16
    calls = cp_attention_calls(spec, Candidate(cp=cp, tp=tp, microbatch_size=B), 1, mode)
    if mode == "allgather":
        assert all(c.payload == own * cp and c.sent == own * (cp - 1) for c in calls)
    else:
        assert [c.sent for c in calls] == [(cp - 1) * own, (2 * cp - 1) * own]
