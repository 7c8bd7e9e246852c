"""Routing requests over replicas: the same tokens whatever the route; least-loaded beats
round-robin when one replica is slow."""

from functools import cache

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.infer import Request, SamplingParams, serve
from minidist.infer.router import choose, outstanding_tokens, poisson_arrivals, route
from minidist.infer.scheduler import Scheduler
from minidist.nn import GPT, GPTConfig
from minidist.resilience.stragglers import Slowdown

V = 32


@cache
def model():
    return GPT(GPTConfig(vocab_size=V, block_size=32, n_layer=1, n_head=2, d_model=16, seed=3))


def _requests(specs, temperature=0.0):
    sampling = SamplingParams(temperature=temperature) if temperature else SamplingParams()
    return [Request(i, p, n, sampling) for i, (p, n) in enumerate(specs)]


@given(specs=st.lists(st.tuples(st.lists(st.integers(0, V - 1), min_size=1, max_size=6), st.integers(0, 6)),
                      min_size=1, max_size=8),
       replicas=st.integers(1, 3), temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 3))
def test_every_route_gives_the_tokens_of_one_replica(specs, replicas, temperature, seed):
    reqs = _requests(specs, temperature)
    want, _, _ = serve(model(), reqs, max_batch=2)  # one replica, every request: the reference
    arrivals = poisson_arrivals(len(reqs), rate=500, seed=seed)
    for policy in ("round_robin", "least_loaded"):
        got = route(model(), reqs, arrivals, replicas=replicas, policy=policy, max_batch=2)
        assert got.outputs == want, policy
        assert set(got.latency) == {r.id for r in reqs} and min(got.latency.values()) >= 0


def test_least_loaded_counts_queued_and_running_tokens():
    a, b = Scheduler(model(), max_batch=2), Scheduler(model(), max_batch=2)
    a.submit(Request(0, [1, 2, 3], 5))          # 3 prompt + 5 new = 8 tokens queued
    b.submit(Request(1, [1], 2))                # 1 + 2 = 3
    b.submit(Request(2, [1, 2], 1))             # 2 + 1 = 3
    assert (outstanding_tokens(a), outstanding_tokens(b)) == (8, 6)
    assert choose("least_loaded", [a, b], 0) == 1 and choose("round_robin", [a, b], 0) == 0
    b.step()                                    # both admitted, one token each: 2 - 1 + 1 - 1 = 1 left
    assert outstanding_tokens(b) == 1
    idle = [Scheduler(model(), max_batch=2) for _ in range(3)]
    assert [choose("least_loaded", idle, k) for k in range(4)] == [0, 1, 2, 0]  # ties: round-robin


def test_a_slow_replica_gets_less_and_least_loaded_beats_round_robin():
    rng = np.random.default_rng(0)
    reqs = _requests([(rng.integers(0, V, 4).tolist(), 8) for _ in range(24)])
    arrivals = poisson_arrivals(len(reqs), rate=100, seed=1)
    slow = Slowdown("rank=1,factor=4", pace=0.002)  # paced: the clock counts rows, not this machine's load
    rr = route(model(), reqs, arrivals, replicas=3, policy="round_robin", slow=slow)
    ll = route(model(), reqs, arrivals, replicas=3, policy="least_loaded", slow=slow)
    assert ll.outputs == rr.outputs
    counts = np.bincount(list(ll.replica_of.values()), minlength=3)
    assert counts[1] < counts[0] and counts[1] < counts[2], counts
    assert np.bincount(list(rr.replica_of.values())).tolist() == [8, 8, 8]
    assert ll.percentile(99) < 0.8 * rr.percentile(99) and ll.throughput > rr.throughput


def test_route_errors_name_the_argument():
    reqs = _requests([([1], 2)])
    with pytest.raises(ValueError, match="policy must be one of"):
        route(model(), reqs, [0.0], policy="random")
    with pytest.raises(ValueError, match="one arrival time >= 0"):
        route(model(), reqs, [])
    with pytest.raises(ValueError, match="slows rank 3, but there are only 2"):
        route(model(), reqs, [0.0], replicas=2, slow=Slowdown("rank=3,factor=2"))
    with pytest.raises(ValueError, match="slow must slow replicas as a Slowdown does"):
        route(model(), reqs, [0.0], replicas=2, slow="rank=1,factor=2")


def test_measured_pace_is_busy_over_rows_and_a_replica_not_run_yet_gets_the_mean():
    from minidist.infer.router import measured_pace

    # replicas 0 and 2 ran: 2.0/4 = 0.5 and 6.0/4 = 1.5 s per token; replica 1 none yet: their mean, 1.0
    assert measured_pace([4, 0, 4], [2.0, 0.0, 6.0]) == [0.5, 1.0, 1.5]
    assert measured_pace([0, 0], [0.0, 0.0]) == [1.0, 1.0]


def test_least_loaded_weighs_outstanding_tokens_by_each_replicas_pace():
    """Replica 0 has 8 tokens queued, replica 1 has 6: by tokens alone 1 is chosen; at paces 0.5 and 1.0
    s/token replica 0 finishes its queue in 4 s, replica 1 in 6 s, so 0 is."""
    a, b = Scheduler(model(), max_batch=2), Scheduler(model(), max_batch=2)
    a.submit(Request(0, [1, 2, 3], 5))
    b.submit(Request(1, [1], 2))
    b.submit(Request(2, [1, 2], 1))
    assert choose("least_loaded", [a, b], 0) == 1
    assert choose("least_loaded", [a, b], 0, [0.5, 1.0]) == 0
    assert choose("least_loaded", [a, b], 0, [1.0, 1.5]) == 0  # 8 x 1.0 < 6 x 1.5
    assert choose("least_loaded", [a, b], 0, [1.0, 1.0]) == 1


def test_a_request_arriving_exactly_when_a_replica_steps_is_routed_before_that_step():
    """With a pace of 1 s per row (the real compute, microseconds, is negligible) the clocks are whole
    seconds: request 0's prefill (2 rows) ends at t = 2.0, where its next step starts. Request 1 arriving
    at exactly 2.0 joins that step, as one arriving a hair earlier does -- the same finish times; one
    arriving a hair later waits for the step in flight, and request 0 (no longer sharing steps with it
    from then on) finishes sooner."""
    hair = 2 ** -10

    def finish(at):
        reqs = [Request(0, [1, 2], 3), Request(1, [3], 2)]
        lat = route(model(), reqs, [0.0, at], replicas=1, slow=Slowdown("", pace=1.0)).latency
        return lat[0], lat[1] + at

    assert finish(2.0) == pytest.approx(finish(2.0 - hair), abs=1e-6)
    assert finish(2.0)[0] > finish(2.0 + hair)[0] + 0.5


def test_measured_pace_counts_a_replica_that_has_run_one_row():
    from minidist.infer.router import measured_pace

    assert measured_pace([1, 0, 2], [3.0, 0.0, 2.0]) == [3.0, 2.0, 1.0]  # the idle one: mean(3, 1)
    assert measured_pace([0, 0], [0.0, 0.0]) == [1.0, 1.0]
