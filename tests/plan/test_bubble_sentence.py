"""The planner's one line on why a predicted bubble is not the textbook's, against hand-worked values.

The hand machine: arithmetic is free, each layer's Python costs 1 ms per microbatch (forward 1/3,
backward 2/3), a message 1 ms and its bytes nothing, the update nothing. SPEC is embedding, 2 blocks,
head; pp = 2 puts [embedding, block] and [block, head] on the stages: 2 ms each per microbatch, so
F = 2/3 ms and B = 4/3 ms. One microbatch (m = 1), sends c = 1 ms, both stages idle while the other
works: stage 0 F [0, 2/3], the activation arrives at 5/3, stage 1 F + B until 11/3, the gradient
arrives at 14/3, stage 0 B until 6. Makespan 6 ms, each stage busy 2 ms: bubble 1 - 2/6 = 66.7%
(= (F+B+2c) / (2(F+B)+2c)); the textbook (p-1)/(m+p-1) = 1/2 = 50.0%.
"""

from __future__ import annotations

import pytest

from minidist.plan.hardware import Hardware, Link
from minidist.plan.mesh import Candidate
from minidist.plan.model import ModelSpec
from minidist.plan.steptime import predict

SPEC = ModelSpec("tiny", n_layer=2, d_model=16, n_head=4, vocab=32, seq=8, engine="minidist", dtype_bytes=4)
B = 8


def hand_machine(**sharing) -> Hardware:
    link = Link(1e30, 1e-3, "hand")
    k = {"linear_flops": 1e30, "gelu": 0.0, "layer_norm": 0.0, "elementwise": 0.0, "attention_score": 0.0,
         "cross_entropy": 0.0, "adamw": 0.0, "python_block": 1e-3, "python_ends": 2e-3}
    return Hardware("hand", 1e12, 1e12, 1e12, intra=link, inter=link, chips_per_domain=10**6,
                    gemm_efficiency=1.0, kernels=k, **sharing)


TEXTBOOK = ("where the textbook (p-1)/(m+p-1) = 1/2 = 50.0% for p = 2 stages, m = 1 microbatch per replica "
            "counts only the warm-up and cool-down of stages that send for free, each on a core of its own. "
            "What differs here: ")
SENDS = "each send between stages takes 1 ms (the link's alpha + bytes/beta), and the schedule simulated " \
        "with them idles 66.7%"


def test_the_sentence_names_the_formula_its_p_and_m_and_the_sends_it_adds():
    got = predict(SPEC, Candidate(pp=2, microbatch_size=B), B, hand_machine())
    assert got.microbatches == 1
    assert got.step == pytest.approx(6e-3)
    assert got.bubble_fraction == pytest.approx(4 / 6)
    assert got.bubble_why == f"bubble 66.7%, {TEXTBOOK}{SENDS}"


def test_ranks_sharing_the_cores_stretch_the_work_not_the_waits():
    """0.5 cores for 2 ranks: their work runs 4x slower (8 ms busy per stage), the 4 ms each stage
    waits does not: makespan 12 ms, bubble 4/12 = 33.3%."""
    got = predict(SPEC, Candidate(pp=2, microbatch_size=B), B, hand_machine(cores=0.5))
    assert got.step == pytest.approx(12e-3)
    assert got.bubble_fraction == pytest.approx(4 / 12)
    assert got.bubble_why == (
        f"bubble 33.3%, {TEXTBOOK}{SENDS}; 2 ranks share this machine's cores: each rank's work runs 4x "
        "slower while its waits do not (a waiting rank's core runs the others' work), so the idle share "
        "falls to 33.3%")


def test_no_sentence_when_the_bubble_is_the_textbooks():
    """Free sends (latency 0): the simulated 1F1B is the textbook's 50.0%, and nothing is explained."""
    free = hand_machine().with_(intra=Link(1e30, 0.0), inter=Link(1e30, 0.0))
    got = predict(SPEC, Candidate(pp=2, microbatch_size=B), B, free)
    assert got.bubble_fraction == pytest.approx(0.5) and got.bubble_why == ""


# m = 2 (microbatches of 4): the same 1 ms per layer and microbatch, sends 1 ms. minidist's runtime
# posts its sends in the background (isend), so a message sent at t arrives at t + 1 ms whenever its
# receive is posted. By hand: stage 1 takes activation 1 at 11/3 (it arrived at 7/3), sends gradient 0
# (arrives 14/3), F1 + B1 until 17/3, gradient 1 arrives 20/3; stage 0 runs B0 [14/3, 6], B1 [20/3, 8]:
# 8 ms. Sends that wait for their receive (rendezvous, Megatron's 1F1B) take 10 ms by the same count.
RENDEZVOUS_MS, BACKGROUND_MS = 10.0, 8.0


def test_two_microbatches_are_priced_with_sends_in_the_background_not_rendezvous():
    got = predict(SPEC, Candidate(pp=2, microbatch_size=B // 2), B, hand_machine())
    assert got.microbatches == 2
    assert got.step < RENDEZVOUS_MS * 1e-3 - 1e-9


def test_two_microbatches_take_the_hand_worked_8_ms():
    """A background send is in flight from when it is sent: a receive posted late ends at
    max(posted, sent + comm), not max(posted, sent) + comm (which paid the send again: 28/3 ms)."""
    got = predict(SPEC, Candidate(pp=2, microbatch_size=B // 2), B, hand_machine())
    assert got.step == pytest.approx(BACKGROUND_MS * 1e-3)
