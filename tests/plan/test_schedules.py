"""The planner's pipeline-schedule formulas against values worked out by hand from the papers' tables.

Each row: the bubble time a stage idles, from the paper's expression with the given F, B, W (times of
one microbatch through one stage; B the input-gradient half, W the weight-gradient half), then the
fraction bubble / (bubble + m(F+B+W)), written as the fraction it reduces to.
"""

import pytest

from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.simulate import peak_activations
from minidist.plan import schedules
from minidist.plan.hardware import Hardware, Link
from minidist.plan.mesh import Candidate, memory, stage_param_counts
from minidist.plan.model import ModelSpec
from minidist.plan.steptime import predict

# (schedule, p, m, F, B, W, v, fraction by hand)
BUBBLES = [
    ("gpipe", 2, 1, 1, 1, 1, 1, 3 / 6),        # 1·3 idle, 1·3 work: the textbook 50% at p = 2, m = 1
    ("1f1b", 4, 8, 1, 1, 1, 1, 9 / 33),        # 3·3 idle, 8·3 work: (p-1)/(m+p-1) = 3/11
    ("1f1b", 2, 4, 2, 1, 1, 1, 4 / 20),        # 1·4 idle, 4·4 work
    ("interleaved", 4, 8, 1, 1, 1, 2, 4.5 / 28.5),  # 9/2 idle: (p-1)/(v·m+p-1) = 3/19
    ("zb_h1", 4, 8, 1, 1, 1, 1, 3 / 27),       # (p-1)(F+B-W) = 3: (p-1)/(3m+p-1) = 1/9
    ("zb_h1", 2, 4, 2, 1, 1, 1, 2 / 18),       # 1·(2+1-1) = 2 idle, 4·4 work
    ("zb_h1", 3, 4, 1, 1, 3, 1, 2 / 22),       # W > F, B: 2·max(1+1-3, 1, 1) = 2 idle (not 2·(-1)), 4·5 work
    ("zb_h1", 3, 4, 1, 3, 2, 1, 6 / 30),       # W < B but W > F: 2·max(2, 1, 3) = 6 idle, 4·6 work
    ("zb_h2", 4, 8, 1, 1, 1, 1, 0.0),          # (p-1)(F+B-2W) = 0
    ("zb_h2", 4, 8, 2, 1, 1, 1, 3 / 35),       # 3·(2+1-2) = 3 idle, 8·4 work
    ("zb_h2", 3, 4, 1, 1, 2, 1, 0.0),          # 2·(1+1-4) < 0: no negative idling
    ("zb_v", 4, 8, 1, 1, 1, 2, 0.0),           # zero at F = B = W (the paper's table)
    ("dualpipe", 4, 8, 1, 1, 1, 1, 1 / 25),    # (p/2-1)(F&B + B' - 3W), F&B = F+W = 2, B' = 2: 1·1
    ("dualpipe", 8, 16, 2, 1, 1, 1, 6 / 70),   # 3·((2+1) + 2 - 3) = 6 idle, 16·4 work
    ("dualpipe_v", 4, 8, 1, 1, 1, 2, 1.5 / 25.5),  # 8 half-stage chunks: 3·((0.5+0.5) + 1 - 1.5) = 1.5
]


@pytest.mark.parametrize("name, p, m, F, B, W, v, want", BUBBLES)
def test_bubble_fraction_is_the_papers_formula_worked_by_hand(name, p, m, F, B, W, v, want):
    assert schedules.get(name).bubble_fraction(p, m, F, B, W, v) == pytest.approx(want)


# (schedule, p, m, v, most microbatches' activations on the fullest stage, in one stage's M_B)
PEAKS = [
    ("gpipe", 4, 8, 1, 8), ("1f1b", 4, 8, 1, 4), ("1f1b", 4, 2, 1, 2),
    ("interleaved", 4, 8, 2, 5.5),   # 2·3 + 1·4 warm-up chunks + 1, each half of M_B
    ("interleaved", 4, 4, 2, 4),     # m = p: every forward first
    ("zb_h1", 4, 8, 1, 4), ("zb_h2", 4, 8, 1, 7), ("zb_h2", 4, 3, 1, 3), ("zb_v", 4, 8, 2, 4),
    ("dualpipe", 4, 8, 1, 5),        # PP + 1
    ("dualpipe_v", 4, 8, 2, 4.5),    # 2p + 1 half-stage chunks
    ("dualpipe_v", 4, 2, 2, 2),
]


@pytest.mark.parametrize("name, p, m, v, want", PEAKS)
def test_peak_activations_by_hand(name, p, m, v, want):
    assert schedules.get(name).peak(p, m, v) == pytest.approx(want)


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1),
                                          ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 2),
                                          ("interleaved", 4, 4, 2), ("zb_h1", 4, 8, 1), ("zb_h1", 2, 6, 1)])
def test_the_runtimes_schedules_hold_what_the_formula_says_on_stage_0(name, p, m, v):
    """The instruction lists the runtime executes hold exactly the formula's peak (in chunks)."""
    held = peak_activations(make_schedule(name, p, m, v)[0])
    assert held == pytest.approx(schedules.get(name).peak(p, m, v) * v)


def test_sharing_the_cores_stretches_work_not_waits():
    """1F1B, p = 2, m = 1, each rank's work 4x slower: 1·3 idle against 4·3 work -> 3/15."""
    assert schedules.on_shared_cores(schedules.get("1f1b"), 2, 1, 4.0) == pytest.approx(3 / 15)
    assert schedules.on_shared_cores(schedules.get("1f1b"), 2, 1, 0.5) == pytest.approx(0.5)  # never faster


def test_names_and_errors():
    assert schedules.get("zb-h1") is schedules.get("zb_h1")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb-h9'.*1f1b.*zb_h1"):
        schedules.get("zb-h9")
    assert schedules.textbook(2, 1) == pytest.approx(0.5)


# a chip where every op's time is its FLOPs over a round peak, no per-op cost and free links:
# backward = 2 x forward exactly, so F = f, B = W = f for the split schedules
FREE = Link(1e30, 0.0, "free")
CHIP = Hardware("round", 1e12, 1e15, 1e30, intra=FREE, inter=FREE, chips_per_domain=1024)
GPT = ModelSpec("gpt", n_layer=8, d_model=256, n_head=8, vocab=1024, seq=128)


@pytest.mark.parametrize("name, want", [("1f1b", 3 / 11), ("zb_h1", 3 / 27), ("dualpipe", 1 / 25),
                                        ("zb_h2", 0.0)])
def test_planner_step_uses_each_schedules_formula(name, want):
    """p = 4, m = 8 (batch 8 of microbatch size 1): the quick estimate's bubble is the formula with
    F = f, B = W = f (hand values above); the step is m·3f plus that idling."""
    cand = Candidate(pp=4, microbatch_size=1, schedule=name)
    pred = predict(GPT, cand, 8, CHIP, simulate_schedule=False)
    assert pred.microbatches == 8
    assert pred.bubble_fraction == pytest.approx(want)


def test_dualpipe_holds_two_copies_of_the_parameters():
    """bf16 weights (2 bytes) and fp32 master + Adam moments (12 bytes) of the fullest stage, twice."""
    two = memory(GPT, Candidate(pp=4, schedule="dualpipe"), 8)
    n, _ = stage_param_counts(GPT, Candidate(pp=4), two["stage"])
    assert (two["params"], two["optimizer"]) == (2 * 2 * n, 2 * 12 * n)


def test_a_candidate_names_its_schedule_as_the_registry_does():
    assert Candidate(pp=2, schedule="zb-h1").schedule == "zb_h1"
    assert Candidate(pp=2, schedule="zb_v").chunks == 2  # the V runs two chunks per stage
    with pytest.raises(ValueError, match="zb_v runs 2 chunks per stage, got chunks=4"):
        Candidate(pp=2, schedule="zb_v", chunks=4)
    with pytest.raises(ValueError, match="unknown pipeline schedule '2f2b'"):
        Candidate(pp=2, schedule="2f2b")


@pytest.mark.parametrize("name, p, chunks", [("zb_h1", 4, 1), ("zb_h1", 3, 1), ("dualpipe", 4, 1),
                                             ("dualpipe", 8, 1), ("dualpipe_v", 4, 2)])
@pytest.mark.parametrize("F, B, W", [(1, 1, 1), (1, 1, 0.5), (1.5, 1, 0.5), (2, 1, 1), (1, 0.6, 0.4)])
def test_formula_is_what_the_runtimes_order_takes_in_the_simulator(name, p, chunks, F, B, W):
    """F >= B >= W: the formula's idle time equals the simulated step of the instruction lists the
    runtime runs (each chunk 1/chunks of a stage's F, B, W) less the stage's work."""
    from minidist.parallel.pipeline.simulate import simulate

    m = 2 * p + 2
    v = chunks
    sim = simulate(schedules.build(name, p, m, v), F / v, (B + W) / v, input_time=B / v, weight_time=W / v)
    assert sim.makespan - m * (F + B + W) == pytest.approx(schedules.get(name).bubble(p, m, F, B, W, v))


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h1s_per_stage_memory_is_the_runtimes(p):
    """ZB-H1 by hand: stage s holds p - s microbatches from F to B (M_B) and s + 1 from B to W (M_W:
    its order puts off s W's and runs one after each B); the runtime's lists hold exactly that."""
    from minidist.parallel.pipeline.simulate import peak_pending_weights

    model = schedules.get("zb_h1")
    for m in (p, 2 * p + 1):
        lists = make_schedule("zb-h1", p, m)
        assert [model.stage_peak(p, m, 1, s) for s in range(p)] == [p - s for s in range(p)]
        assert [model.stage_pending(p, m, 1, s) for s in range(p)] == [s + 1 for s in range(p)]
        assert [peak_activations(ops) for ops in lists] == [p - s for s in range(p)]
        assert [peak_pending_weights(ops) for ops in lists] == [s + 1 for s in range(p)]
    assert schedules.get("1f1b").stage_pending(4, 8, 1, 0) is None


@pytest.mark.parametrize("p, m, want", [(4, 2, [1, 2, 2, 2]), (4, 8, [1, 2, 3, 4]), (3, 1, [1, 1, 1]),
                                        (1, 5, [1])])
def test_zb_h1s_w_queue_in_microbatches_by_hand_with_fewer_microbatches_than_stages(p, m, want):
    """M_W of stage s: s + 1, but never more microbatches than the step has."""
    assert [schedules.get("zb_h1").stage_pending(p, m, 1, s) for s in range(p)] == want


@pytest.mark.parametrize("p, m, v, want", [
    (4, 8, 2, [5.5, 4.5, 3.5, 2.5]),   # (2(p-s-1) + (v-1)p + 1)/v: 11/2, 9/2, 7/2, 5/2
    (4, 4, 2, [4, 4, 4, 4]),           # m = p: every forward first, all m·v chunks (m in M_B)
    (2, 8, 3, [7 / 3, 5 / 3]),         # rank 0: 2·1 + 2·2 + 1 = 7 chunks; rank 1: 0 + 4 + 1 = 5
    (2, 2, 3, [2, 2]),                 # m = p again
    (4, 12, 2, [5.5, 4.5, 3.5, 2.5]),  # more microbatches: the warm-up, not m, sets it
])
def test_interleaved_peak_per_stage_by_hand(p, m, v, want):
    """Megatron's interleaved 1F1B: stage s runs 2(p-s-1) + (v-1)p warm-up forwards of one chunk, then
    the steady state's first forward, each 1/v of a microbatch's activations (M_B)."""
    got = [schedules.interleaved_peak(p, m, v, s) for s in range(p)]
    assert got == pytest.approx(want)


def test_sharing_the_cores_at_exactly_one_slowdown_is_the_formula():
    """slowdown 1 (a core per rank) and below: the schedule's own fraction, 1F1B p = 4, m = 8: 3/11."""
    for s in (1.0, 0.5, 0.0):
        assert schedules.on_shared_cores(schedules.get("1f1b"), 4, 8, s) == pytest.approx(9 / 33)
    assert schedules.on_shared_cores(schedules.get("1f1b"), 1, 8, 3.0) == 0.0  # one stage: no bubble
