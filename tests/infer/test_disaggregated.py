"""Disaggregated prefill/decode == colocated serving == one request at a time; the caches sent are
exactly 2·L·T·d·4 bytes per request that still decodes; bad input named on every rank."""

import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import measure, run
from minidist.infer import GREEDY, Request, SamplingParams, generate
from minidist.infer.colocated import colocated_serve
from minidist.infer.disaggregated import disaggregated_serve
from minidist.nn import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
V, BLOCK, L, D = 32, 48, 2, 32


@cache
def model():
    return GPT(GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=L, n_head=2, d_model=D, seed=2)).eval()


requests = st.lists(st.tuples(st.lists(st.integers(0, V - 1), min_size=1, max_size=20), st.integers(0, 8),
                              st.floats(0, 0.02)), min_size=1, max_size=7)


def alone(r):
    return generate(model(), [r.prompt], r.max_new_tokens, r.sampling, r.stop_tokens, ids=[r.id])[0] \
        if r.max_new_tokens else []


@given(reqs=requests, world=st.integers(2, 4), data=st.data(), temperature=st.sampled_from([0.0, 1.0]),
       stop=st.sets(st.integers(0, V - 1), max_size=2), batch=st.integers(1, 3))
def test_disaggregated_equals_colocated_and_one_at_a_time(reqs, world, data, temperature, stop, batch):
    p = data.draw(st.integers(1, world - 1), label="prefill ranks")
    sp = SamplingParams(temperature=temperature, top_k=8, seed=5)
    rs = [Request(i, pr, n, sp, tuple(stop)) for i, (pr, n, _) in enumerate(reqs)]
    arrivals = [a for _, _, a in reqs]

    def body(comm):
        return (disaggregated_serve(comm, model(), rs, arrivals, prefill_ranks=p, max_batch=batch),
                colocated_serve(comm, model(), rs, arrivals, max_batch=batch))

    res = run(body, ranks=world)
    dis, co = res[0]
    want = {r.id: alone(r) for r in rs}
    assert dis.outputs == co.outputs == want
    assert all(x[0].outputs == want for x in res)  # every rank returns the whole answer
    with_tokens = {i for i, t in want.items() if t}
    assert set(dis.ttft) == set(co.ttft) == with_tokens
    assert set(dis.tpot) == set(co.tpot) == {i for i, t in want.items() if len(t) > 1}
    assert all(v >= 0 for v in [*dis.ttft.values(), *dis.tpot.values()])


def test_kv_bytes_sent_are_the_formula():
    """Prefill rank r sends, per request i % P == r that still has tokens to decode, 2·L·T·d·4
    bytes (T its prompt); a request answered by its first token (max_new_tokens 1) sends none;
    decode ranks send no payload (their results travel as objects, counted as header bytes)."""
    prompts = [[1] * 5, [2] * 17, [3] * 9, [4] * 30, [5] * 2, [6] * 11, [7] * 4]
    new = [4, 6, 1, 3, 8, 2, 5]
    rs = [Request(i, p, n, GREEDY) for i, (p, n) in enumerate(zip(prompts, new))]
    world, p = 5, 2

    def body(comm):
        with measure(comm) as m:
            served = disaggregated_serve(comm, model(), rs, prefill_ranks=p)
        return m.bytes_sent, served

    res = run(body, ranks=world)
    want = [sum(2 * L * len(prompts[i]) * D * 4 for i in range(len(rs)) if i % p == r and new[i] > 1)
            if r < p else 0 for r in range(world)]
    assert [b for b, _ in res] == want == res[0][1].kv_bytes
    assert want[0] == 2 * L * D * 4 * (5 + 2 + 4)  # requests 0, 4, 6; 2 is answered by its first token
    assert res[0][1].outputs == {r.id: alone(r) for r in rs}


def test_decode_ranks_on_a_paged_cache_install_into_blocks():
    """``Scheduler.install`` writes through the cache's own locate/write: a paged pool of small
    blocks, too few for every request at once (installs wait for blocks, decodes preempt), gives the
    same tokens."""
    sp = SamplingParams(temperature=1.0, top_k=8, seed=9)
    rs = [Request(i, [1 + i] * (2 + 7 * (i % 3)), 6, sp) for i in range(6)]
    served = run(lambda c: disaggregated_serve(c, model(), rs, prefill_ranks=1, max_batch=3, cache="paged",
                                               block_len=4, num_blocks=8), ranks=2)[0]
    assert served.outputs == {r.id: alone(r) for r in rs}


def test_summary_is_median_and_p90():
    rs = [Request(i, [1 + i] * (3 + 8 * (i % 2)), 5, GREEDY) for i in range(6)]
    served = run(lambda c: disaggregated_serve(c, model(), rs, prefill_ranks=1), ranks=2)[0]
    s = served.summary()
    assert s["ttft_p50"] == np.percentile(list(served.ttft.values()), 50)
    assert s["tpot_p90"] == np.percentile(list(served.tpot.values()), 90)
    assert s["ttft_p50"] <= s["ttft_p90"] and s["tpot_p50"] <= s["tpot_p90"]


def test_bad_input_is_named_on_every_rank():
    rs = [Request(0, [1, 2], 3)]
    for p in (0, 2, 1.5, True):
        msg = rf"rank \d: prefill_ranks must be an integer in 1..1 .*got {p!r}"
        with pytest.raises(ValueError, match=msg):
            run(lambda c, p=p: disaggregated_serve(c, model(), rs, prefill_ranks=p), ranks=2)
    with pytest.raises(ValueError, match=r"rank \d: give one arrival time >= 0 .* 1 requests, 2 arrivals"):
        run(lambda c: disaggregated_serve(c, model(), rs, [0.0, 1.0]), ranks=2)
    with pytest.raises(ValueError, match=r"rank \d: request 7 has token id 32 .* vocab_size 32"):
        run(lambda c: colocated_serve(c, model(), [Request(7, [V], 2)]), ranks=2)


PROGRAM = """
from minidist.comm import run, measure
from minidist.infer import Request, SamplingParams, generate
from minidist.infer.colocated import colocated_serve
from minidist.infer.disaggregated import disaggregated_serve
from minidist.nn import GPT, GPTConfig
m = GPT(GPTConfig(vocab_size=32, block_size=48, n_layer=2, n_head=2, d_model=32, seed=2)).eval()
sp = SamplingParams(temperature=1.0, top_k=8, seed=3)
rs = [Request(i, [1 + i % 7] * (2 + 9 * (i % 3)), 3 + i % 4, sp) for i in range(7)]
def body(c):
    with measure(c) as mm:
        d = disaggregated_serve(c, m, rs, [0.002 * i for i in range(7)], prefill_ranks=1)
    return c.rank, d, colocated_serve(c, m, rs), mm.bytes_sent
((rank, d, co, sent),) = run(body)
want = {r.id: generate(m, [r.prompt], r.max_new_tokens, sp, ids=[r.id])[0] for r in rs}
assert d.outputs == co.outputs == want, (d.outputs, want)
assert sent == (sum(2 * 2 * len(r.prompt) * 32 * 4 for r in rs) if rank == 0 else 0), sent
print(f"OK rank {rank}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
def test_disaggregated_under_mpirun():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    res = subprocess.run(["mpirun", "-n", "3", sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("OK rank") == 3


@pytest.mark.parametrize("serving", ["disaggregated", "colocated"])
def test_a_first_token_that_is_a_stop_token_ends_the_request_at_the_prefill(serving):
    """Request 0's first greedy token is made its stop token: its answer is that one token, its prefill
    sends no cache (0 bytes) and it has a TTFT but no TPOT; request 1 (same prompt, no stop token)
    decodes on."""
    prompt = [3, 1, 4, 1, 5]
    first = generate(model(), [prompt], 1)[0][0]
    rs = [Request(0, prompt, 6, GREEDY, (first,)), Request(1, prompt, 3, GREEDY)]
    serve = disaggregated_serve if serving == "disaggregated" else colocated_serve
    served = run(lambda c: serve(c, model(), rs), ranks=2)[0]
    assert served.outputs == {0: [first], 1: generate(model(), [prompt], 3)[0]}
    assert set(served.ttft) == {0, 1} and set(served.tpot) == {1}
    if serving == "disaggregated":
        assert served.kv_bytes == [2 * L * len(prompt) * D * 4, 0]  # request 1's cache only


def test_kv_message_bytes_by_hand():
    from minidist.infer.disaggregated import kv_message_bytes

    cfg = GPTConfig(vocab_size=8, block_size=8, n_layer=2, n_head=2, d_model=4)
    assert kv_message_bytes(cfg, 3) == 2 * 2 * 3 * 4 * 4 == 192  # (k, v) x layers x tokens x d x float32
    assert kv_message_bytes(cfg, 3, itemsize=2) == 96 and kv_message_bytes(cfg, 1) == 64


def test_ttft_and_tpot_from_the_gathered_times_by_hand():
    """TTFT = first - arrival; TPOT = (last - first) / the gaps between tokens (n - 1); one token: no
    TPOT. Times from two ranks, merged."""
    from minidist.infer.disaggregated import gathered

    class Two:
        def allgather_obj(self, x):
            return [(({0: [5, 6, 7, 8]}, {0: 1.5}, {}, {0: 0.5}), 64, 3.0),
                    (({1: [9]}, {1: 2.0}, {0: 4.5}, {1: 1.0}), 0, 5.0)]

    s = gathered(Two(), None, 0, 0.0)
    assert s.outputs == {0: [5, 6, 7, 8], 1: [9]}
    assert s.ttft == {0: 1.0, 1: 1.0} and s.tpot == {0: 1.0}
    assert s.kv_bytes == [64, 0] and s.makespan == 5.0


@pytest.mark.parametrize("arrivals,ok", [([0.0, 0.0], True), ([0, 2.5], True), ([0.0, -1e-9], False),
                                         ([0.0, float("nan")], False), ([0.0], False)])
def test_arrivals_at_time_zero_are_fine_and_negative_nan_or_missing_ones_are_refused(arrivals, ok):
    from minidist.infer.disaggregated import check_requests

    rs = [Request(0, [1, 2], 2), Request(1, [3], 1)]
    if ok:
        got, at = check_requests(None, model(), rs, arrivals)
        assert [r.id for r in got] == [0, 1] and at == [float(a) for a in arrivals]
    else:
        with pytest.raises(ValueError, match="one arrival time >= 0 \\(seconds\\) per request: 2 requests"):
            check_requests(None, model(), rs, arrivals)
