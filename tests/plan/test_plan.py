"""The planner (minidist.plan) against measurement here and published runs there.

Exact here: tiny minidist trainings on the threads transport; the planner's bytes per collective must
equal the ledger's calls and its memory per kind the MemoryAccountant's. Published runs: expected
values are the papers' numbers and formulas, written out below.
"""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import measure, run
from minidist.nn.footprint import MemoryAccountant
from minidist.plan.mesh import Candidate, memory, stage_param_counts
from minidist.plan.traffic import collectives
from tests.conftest import budget
from tests.plan.conftest import CFG, SPEC, B, batches, check_mesh

MESHES = [(2, 1, 1, 1, None), (1, 2, 1, 1, None), (2, 2, 2, 2, None), (1, 4, 2, 4, None),
          (1, 2, 4, 2, None), (2, 1, 2, 4, "full")]  # dp, tp, pp, microbatches, checkpointing


@pytest.mark.parametrize("dp,tp,pp,m,checkpoint", MESHES)
def test_bytes_and_memory_equal_ledger_and_accountant(dp, tp, pp, m, checkpoint):
    check_mesh(dp, tp, pp, m, checkpoint, CFG, SPEC)


@budget(6)
@given(st.data())
def test_any_mesh_and_shape_equal_ledger_and_accountant(data):
    """Drawn: a mesh of up to 8 ranks, microbatches, checkpointing, depth, width and heads."""
    tp = data.draw(st.sampled_from([1, 2, 4]), "tp")
    pp = data.draw(st.sampled_from([p for p in (1, 2, 4) if tp * p <= 8]), "pp")
    dp = data.draw(st.sampled_from([d for d in (1, 2, 4) if tp * pp * d <= 8]), "dp")
    m = data.draw(st.sampled_from([x for x in (1, 2, 4) if (B // dp) % x == 0]), "microbatches")
    layers = data.draw(st.integers(max(1, pp - 2), 3), "n_layer")
    heads = data.draw(st.sampled_from([h for h in (2, 4) if h % tp == 0]), "n_head")
    width = heads * data.draw(st.sampled_from([2, 3, 4]), "head_dim")
    ckpt = data.draw(st.sampled_from([None, "full"]), "checkpoint")
    cfg = CFG.replace(n_layer=layers, n_head=heads, d_model=width)
    spec = SPEC.replace(n_layer=layers, n_head=heads, d_model=width)
    check_mesh(dp, tp, pp, m, ckpt, cfg, spec)


def test_uneven_ring_chunks_equal_the_ledger():
    """DDP's bucket of 2070 elements over 4 ranks: np.array_split chunks of 518, 518, 517, 517, so
    ranks send different bytes (2N - |chunk r| - |chunk r+1|), not the textbook 2(p-1)/p·N."""
    cfg, spec = CFG.replace(n_layer=1, d_model=10, n_head=2), SPEC.replace(n_layer=1, d_model=10, n_head=2)
    assert stage_param_counts(spec, Candidate(dp=4, microbatch_size=2), 0)[0] % 4  # really uneven
    check_mesh(4, 1, 1, 1, None, cfg, spec)


@pytest.mark.parametrize("dp,tp,pp,m,schedule,chunks", [
    (1, 2, 2, 2, "interleaved", 2), (2, 1, 2, 4, "interleaved", 2), (1, 1, 4, 4, "gpipe", 1)])
def test_other_schedules_equal_ledger_and_accountant(dp, tp, pp, m, schedule, chunks):
    """Interleaved 1F1B (two model chunks per stage: sends per chunk boundary, activations per chunk)
    and GPipe (every microbatch's activations held at once)."""
    check_mesh(dp, tp, pp, m, None, CFG, SPEC, chunks=chunks, schedule=schedule)


@pytest.mark.parametrize("stage,dp,layers", [(1, 4, 3), (2, 4, 3), (3, 2, 2), (3, 4, 3)])
def test_zero_bytes_and_memory_equal_ledger_and_accountant(stage, dp, layers):
    from minidist.nn import GPT, optim
    from minidist.parallel.data.zero import ZeRO

    cfg = CFG.replace(n_layer=layers, d_model=10, n_head=2, vocab_size=29)  # buckets of 1330, 370, 310
    spec = SPEC.replace(n_layer=layers, d_model=10, n_head=2, vocab=29)     # elements: uneven shards
    cand = Candidate(dp=dp, zero=stage, microbatch_size=B // dp)
    x = np.arange(B * 8).reshape(B, 8) % cfg.vocab_size

    def body(comm):
        m, acct = GPT(cfg), MemoryAccountant()
        z = ZeRO(m, comm, lambda ps: optim.AdamW(ps, lr=1e-3), stage=stage)
        mine = x[comm.rank * B // dp:(comm.rank + 1) * B // dp]
        for _ in range(2):  # the second step: optimizer state exists, calls are a steady step's
            with measure(comm) as meas:
                with acct.track_activations(m):
                    loss = m.loss(mine, mine)
                z.backward(loss)
                z.wait_gradients()
                rep = acct.report(m, z)
                z.update()
        return comm.rank, Counter((c.name, c.bytes_sent) for c in meas.calls), rep

    for rank, calls, rep in run(body, ranks=dp):
        want = Counter()
        for c in collectives(spec, cand, B, dp_rank=rank):
            want[(c.name, int(c.sent))] += c.count
        assert calls == want, f"rank {rank}"
        if rank:
            continue  # memory() reports the fullest rank: rank 0 holds the larger np.array_split parts
        mem = memory(spec, cand, B)
        assert (rep["params"], rep["grads"], rep["optimizer_state"], rep["activations_peak"]) == \
            (mem["params"], mem["grads"], mem["optimizer"], mem["activations"])


# -- published runs: expected values are the papers' numbers and formulas --------------------------

def _predict_run(name):
    from minidist.plan import RUNS, predict

    r = RUNS[name]
    mesh = dict(r.mesh)
    cand = Candidate(microbatch_size=mesh.pop("microbatch_size"), **mesh)
    return r, predict(r.model, cand, r.global_batch, r.hardware)


def megatron_flops_per_step(batch, seq, layers, hidden, vocab):
    """Narayanan et al. 2021, eq. (3): FLOPs per iteration with activation recomputation."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


@pytest.mark.parametrize("name,chips,batch,layers,hidden,reported", [
    ("megatron-1t", 3072, 3072, 128, 25600, 163e12),   # Table 1: 163 TFLOP/s per GPU
    ("gpt3-175b", 1536, 1536, 96, 12288, 153e12),      # Table 1: 153 TFLOP/s per GPU
])
def test_megatron_runs_fit_and_match_reported_throughput(name, chips, batch, layers, hidden, reported):
    r, p = _predict_run(name)
    assert p.fits and p.memory["total"] <= 80e9  # A100 80 GB
    # the first stage is the fullest: its blocks (12h² + 2h each) and the embedding (V·h), split 8 ways,
    # at 2 + 2 + 12 bytes per parameter (bf16 weights and grads; fp32 master, Adam m and v)
    pp = r.mesh["pp"]
    psi = (layers // pp * (12 * hidden**2 + 2 * hidden) + 51200 * hidden) // 8
    assert p.memory["params"] + p.memory["grads"] + p.memory["optimizer"] == 16 * psi
    flops = megatron_flops_per_step(batch, 2048, layers, hidden, 51200)
    per_gpu = flops / p.step / chips
    assert abs(per_gpu / reported - 1) <= 0.25, f"{name}: {per_gpu / 1e12:.0f} vs {reported / 1e12:.0f}"


def test_palm_mfu_within_25_percent():
    r, p = _predict_run("palm-540b")
    n = 540.35e9  # PaLM Table 1 / Sec. 4: MFU counts 6N + 12·L·H·Q·T FLOPs per token (Appendix B)
    flops_per_token = 6 * n + 12 * 118 * 48 * 256 * 2048
    mfu = flops_per_token * 2048 * 2048 / p.step / (6144 * 275e12)
    assert p.fits
    assert abs(mfu / 0.462 - 1) <= 0.25, mfu


def test_llama3_405b_mfu_within_25_percent():
    r, p = _predict_run("llama3-405b")
    n = 405e9  # Llama 3 Table 4: BF16 MFU 38-43% on 16,384 H100s (989 TFLOP/s dense)
    tokens = 16 * 2**20  # 16M tokens per batch
    mfu = (6 * n + 12 * 126 * 16384 * 8192) * tokens / p.step / (16384 * 989e12)
    assert p.fits
    assert 0.38 * 0.75 <= mfu <= 0.43 * 1.25, mfu


def test_planner_says_a_70b_model_does_not_fit_one_gpu_and_zero3_needs_many():
    from minidist.plan import MODELS
    from minidist.plan.hardware import H100

    m = MODELS["llama3-70b"]
    one = memory(m, Candidate(), 1)
    assert one["params"] == 2 * m.params() and one["optimizer"] == 12 * m.params()  # 2 + 12 bytes/param
    assert one["total"] > H100.hbm_bytes
    z3 = memory(m, Candidate(dp=64, zero=3, checkpoint="full"), 64)
    assert z3["params"] == 2 * -(-m.params() // 64)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_activation_peak_with_recomputation_equals_accountant(policy):
    """One process, forward and backward both watched: the recomputed block's activations count."""
    from minidist.nn import GPT
    from minidist.parallel.memory.recompute import apply_checkpointing

    model = GPT(CFG.replace(n_layer=3))
    apply_checkpointing(model, policy)
    acct = MemoryAccountant()
    x, y = batches(1)[0]
    with acct.track_activations(model):
        model.loss(x, y).backward()
    cand = Candidate(microbatch_size=B, checkpoint=policy)
    assert acct.peak_activation_bytes == memory(SPEC.replace(n_layer=3), cand, B)["activations"]


def test_planner_compares_its_best_mesh_with_the_published_one():
    """GPT-3 175B on 1536 A100s: the planner ranks a few meshes (the paper's among them) and either
    agrees (published within its top 2) or says what its best changes and why."""
    from minidist.plan import RUNS, predict
    from minidist.plan.search import compare_published

    run = RUNS["gpt3-175b"]
    cands = [Candidate(dp=1536 // (8 * pp), tp=8, pp=pp, checkpoint=ck, microbatch_size=1)
             for pp in (8, 16) for ck in ("full", "selective")]
    out = compare_published(run, top=2, cands=cands, simulate=4)
    best, pub = out["best"], out["published"]
    assert best.fits and best.step <= pub.step
    assert out["agrees"] == (out["rank"] <= 2)
    if not out["agrees"]:  # the explanation names every field the best changes, and the gap
        for field in ("dp", "tp", "pp", "checkpoint"):
            was, now = getattr(pub.cand, field), getattr(best.cand, field)
            if was != now:
                assert f"{field} {was} -> {now}" in out["explanation"]
        assert "largest part of the gap: +" in out["explanation"]
    # selective recomputation (Korthikanti et al. 2022) re-runs only the attention core, full
    # recomputation the whole forward: on the published mesh, selective must be predicted faster
    sel = predict(run.model, pub.cand.replace(checkpoint="selective"), run.global_batch, run.hardware)
    assert sel.compute < pub.compute and sel.memory["activations"] > pub.memory["activations"]


@pytest.mark.parametrize("choice", ["1", "3"])
def test_planning_lesson_runs_the_predicted_best_and_passes(choice, capsys, tmp_path, monkeypatch):
    """The lesson on 4 thread ranks: it plans, trains the best (or 3rd) mesh, its exact checks pass."""
    import json

    from minidist.lessons import planning
    from minidist.plan import hardware

    if not __import__("os").path.exists(hardware.CALIBRATION_PATH):  # no calibration here: a stand-in
        path = tmp_path / "calibration.json"
        path.write_text(json.dumps({"flops": 1e10, "mem_bandwidth": 1e10, "op_overhead": 1e-5, "cores": 2,
                                    "alpha": 1e-5, "beta": 1e-9, "kernels": None}))
        monkeypatch.setattr(hardware, "CALIBRATION_PATH", str(path))
    results = planning.main(["--ranks", "4", "--steps", "3", "--layers", "2", "--width", "32",
                             "--batch", "8", "--choice", choice])
    out = capsys.readouterr().out
    assert all(results) and "bytes and memory: PASS (exact)" in out and "serial twin" in out


def test_cli_prints_the_ranked_table_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from minidist.plan.__main__ import main

    png = tmp_path / "plan.png"
    main(["--model", "llama3-8b", "--chips", "16", "--batch", "64", "--hardware", "h100", "--top", "3",
          "--mesh", "dp=16,zero=3", "--mesh", "tp=8,zero=1", "--mesh", "tp=4,pp=2,zero=1",
          "--plot", str(png)])
    out = capsys.readouterr().out
    assert " 1 dp" in out and "best" in out and "memory per device by kind" in out
    assert png.stat().st_size > 10_000


def test_cli_refuses_an_impossible_mesh_and_says_what_would_do(capsys):
    from minidist.plan.__main__ import main

    with pytest.raises(SystemExit):
        main(["--model", "llama3-70b", "--chips", "6", "--mesh", "tp=3,pp=2", "--hardware", "h100"])
    err = capsys.readouterr().err
    assert "64 heads do not split over tp=3" in err and "divides 64" in err
    with pytest.raises(SystemExit):  # an unknown model: the names there are, not a KeyError
        main(["--model", "tiny", "--hardware", "h100"])
    err = capsys.readouterr().err
    assert "--model: invalid choice: 'tiny'" in err and "llama3-70b" in err


# (argv, words the one error line must hold): impossible planner input, refused before any search
CLI_BAD = [
    (["--chips", "0"], ["--chips", ">= 1"]),
    (["--chips", "-8"], ["--chips", ">= 1"]),
    (["--chips", "10000000"], ["--chips", "<= 1,048,576", "10000000"]),
    (["--batch", "0"], ["--batch", ">= 1"]),
    (["--top", "0"], ["--top", ">= 1"]),
    (["--mesh", "dp=x"], ["--mesh", "dp='x' is not an integer"]),
    (["--mesh", "dp=-1,tp=-64"], ["--mesh", "dp=-1 must be an integer >= 1"]),
    (["--mesh", "tp=8,checkpoint=banana"], ["checkpoint='banana'", "none, selective, full"]),
    (["--mesh", "tp=8,schedule=zigzag"], ["schedule='zigzag'", "1f1b"]),
    (["--mesh", "tp=8,zero=4"], ["zero=4", "0, 1, 2 or 3"]),
    (["--mesh", "tp=128"], ["--mesh", "more than the 64 chips"]),
    (["--model", "custom"], ["--model custom", "--layers --d-model --heads --vocab --seq"]),
    (["--model", "custom", "--layers", "2", "--d-model", "64"], ["--heads --vocab --seq"]),
    (["--model", "custom", "--layers", "2", "--d-model", "10", "--heads", "3", "--vocab", "9", "--seq", "8"],
     ["d_model 10 not divisible by n_head 3"]),
    (["--layers", "0"], ["--layers", ">= 1"]),
    (["--plot", "/nonexistent-minidist/plan.png"], ["--plot", "does not exist"]),
    (["--mesh", "tp=8,pp=2,microbatch=4"], ["microbatch_size=4", "microbatches=N"]),
    (["--chips", "8", "--mesh", "pp=8,microbatches=4,schedule=zb_h1"], ["zb_h1 with m = 4", "pp=8"]),
    (["--chips", "6", "--batch", "6", "--mesh", "pp=3,schedule=dualpipe"], ["even pp"]),
]


@pytest.mark.parametrize("argv,words", CLI_BAD, ids=[" ".join(a) for a, _ in CLI_BAD])
def test_cli_refuses_impossible_input_with_one_line(capsys, monkeypatch, argv, words):
    from minidist.plan import __main__ as cli

    def no_search(*a, **k):  # every refusal happens before the search
        raise AssertionError("searched")

    monkeypatch.setattr(cli, "plan", no_search)
    with pytest.raises(SystemExit) as info:
        cli.main(["--hardware", "h100", *argv])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("python -m minidist.plan: error: "), lines
    for w in words:
        assert w in lines[-1], f"{w!r} not in {lines[-1]!r}"


def test_plan_refuses_an_impossible_request_by_name():
    from minidist.plan import hardware
    from minidist.plan.presets import MODELS
    from minidist.plan.search import plan

    for kw, words in ((dict(chips=0), "chips must be"), (dict(batch=-1), "batch must be"),
                      (dict(chips=1 << 21), "more than 1,048,576"), (dict(top=0), "top must be")):
        args = dict(chips=8, batch=8, top=1) | kw
        with pytest.raises(ValueError, match=words):
            plan(MODELS["llama3-8b"], args["chips"], args["batch"], hardware.get("h100"), top=args["top"])


def test_here_reads_the_calibration_as_written(tmp_path):
    import json

    from minidist.plan import hardware

    c = {"cpu": "X", "cores": 4, "cores_free": 3.5, "cores_threads": 1.2, "cores_threads_crowded": 0.9,
         "flops": 5e10,
         "mem_bandwidth": 2e10, "op_overhead": 1e-5, "alpha": 2e-5, "beta": 1e-9, "kernels": {"adamw": 1e-9}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(c))
    threads, mpi = hardware.here(str(path)), hardware.here(str(path), transport="mpi")
    assert (threads.cores, threads.gil, mpi.cores, mpi.gil) == (1.2, True, 3.5, False)
    assert (threads.cores_crowded, threads.cpus) == (0.9, 4)
    assert threads.intra.bandwidth == pytest.approx(1e9) and threads.intra.latency == 2e-5
    assert threads.peak_flops == 5e10
    with pytest.raises(FileNotFoundError, match="python -m minidist.calibrate"):
        hardware.here(str(tmp_path / "missing.json"))


def _hand_machine(**sharing):
    """A machine whose numbers are easy to add up by hand: arithmetic is free, a block's Python costs
    1 ms (forward + backward), the embedding's and the head's 1 ms each (2 ms together), every
    collective step 1 ms and its bytes nothing, the update nothing."""
    from minidist.plan.hardware import Hardware, Link

    link = Link(1e30, 1e-3, "hand")
    k = {"linear_flops": 1e30, "gelu": 0.0, "layer_norm": 0.0, "elementwise": 0.0, "attention_score": 0.0,
         "cross_entropy": 0.0, "adamw": 0.0, "python_block": 1e-3, "python_ends": 2e-3}
    return Hardware("hand", 1e12, 1e12, 1e12, intra=link, inter=link, chips_per_domain=10**6,
                    gemm_efficiency=1.0, kernels=k, **sharing)


def test_step_time_here_when_ranks_share_the_cores_adds_up_by_hand():
    """SPEC = embedding, 2 blocks, head: 4 ms of Python per microbatch. A ring all-reduce over p ranks:
    2(p-1) steps of 1 ms. Alone (one chip per rank) the DP all-reduce hides under the backward (2/3 of
    the work); shared, each rank runs ranks/cores times slower and nothing hides."""
    from minidist.plan.steptime import predict

    alone = _hand_machine()
    threads = _hand_machine(cores=1.5, cores_crowded=0.5, cpus=2, gil=True)
    mpi = _hand_machine(cores=1.6, cores_crowded=0.5, cpus=2, gil=False)
    one = Candidate(microbatch_size=8)
    dp8, dp2 = Candidate(dp=8, microbatch_size=1), Candidate(dp=2, microbatch_size=4)
    assert predict(SPEC, one, B, alone).step == pytest.approx(4e-3)
    # the step's own Python: 2 blocks x 12 + 2 + 3 = 29 parameter tensors at 0.1 ms, and 1 ms once
    stepping = alone.with_(kernels={**alone.kernels, "python_tensor": 1e-4, "python_step": 1e-3})
    assert predict(SPEC, one, B, stepping).step == pytest.approx(4e-3 + 29e-4 + 1e-3)
    assert predict(SPEC, dp8, B, alone).step == pytest.approx(4e-3 + (14e-3 - 2 / 3 * 4e-3))
    # 8 thread ranks on 2 CPUs: the crowded cores (0.5) -> 16 x slower; the all-reduce's 14 ms
    # (a link measured with 2 ranks sharing 1.5 cores' worth) by what 8 ranks add: 16 / (2 / 1.5)
    assert predict(SPEC, dp8, B, threads).step == pytest.approx(8 / 0.5 * 4e-3 + 14e-3 * 16 / (2 / 1.5))
    # 8 processes: the free cores (1.6), no GIL; the link by 8 / 1.6 over 2 / 1.6
    assert predict(SPEC, dp8, B, mpi).step == pytest.approx(8 / 1.6 * 4e-3 + 14e-3 * 4)
    # 2 processes fit on the 2 CPUs: 1.6 cores' worth; the link as measured
    assert predict(SPEC, dp2, B, mpi).step == pytest.approx(2 / 1.6 * 4e-3 + 2e-3)
    # 2 thread ranks: 1.5 cores' worth would give 2 / 1.5 x 4 ms, but their Python (all the work here)
    # shares one GIL: 2 x 4 ms one after the other; the all-reduce as measured with 2 ranks
    assert predict(SPEC, dp2, B, threads).step == pytest.approx(2 * 4e-3 + 2e-3)


def test_pipeline_bubble_is_not_stretched_when_ranks_share_the_cores():
    """pp=2: stages [embedding, block] and [block, head], 2 ms of Python per microbatch each. Shared,
    the ranks' busy time stretches by ranks / cores; the bubble (a rank idles, its core serves the
    other) does not."""
    from minidist.plan.steptime import predict

    cand = Candidate(pp=2, microbatch_size=2)  # 4 microbatches
    alone = predict(SPEC, cand, B, _hand_machine())
    shared = predict(SPEC, cand, B, _hand_machine(cores=1.5, cpus=2, gil=True))
    busy = 4 * 2e-3
    assert alone.step > busy  # a bubble and point-to-point waits exist to leave unstretched
    assert shared.step == pytest.approx(2 / 1.5 * busy + (alone.step - busy))


def test_cli_names_the_microbatch_count_as_the_lessons_do_and_searches_a_schedule(capsys):
    """`microbatches=8` is the lessons' count: batch 64 over dp=2 replicas x 8 = microbatch size 4;
    the table shows m and the size apart; --schedule zb_h1 puts ZB-H1 in every pipelined row."""
    from minidist.plan.__main__ import main

    main(["--model", "llama3-8b", "--chips", "16", "--batch", "64", "--hardware", "h100", "--top", "2",
          "--mesh", "tp=4,pp=2,microbatches=8"])
    out = capsys.readouterr().out
    assert "mbsize=4" in out and "#1 runs m = 8 microbatches of 4 sequences per replica" in out
    main(["--model", "llama3-8b", "--chips", "16", "--batch", "64", "--hardware", "h100", "--top", "20",
          "--schedule", "zb-h1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if " pp" in line and "z" in line]
    piped = [r for r in rows if " pp1 " not in r]
    assert piped and all(r.split()[7] == "zb_h1" for r in piped), piped


def test_a_bubble_far_from_the_textbook_says_why():
    """pp=2 with ONE microbatch: the textbook (p-1)/(m+p-1) is 50%. On the hand machine with 2 ranks
    sharing 1.5 cores' worth (GIL), the planner predicts less, and its line says the ranks share the
    cores; alone on chips of their own, the bubble is the textbook's and no line is printed."""
    from minidist.plan.steptime import predict

    cand = Candidate(pp=2, microbatch_size=B)  # one microbatch
    alone = predict(SPEC, cand, B, _hand_machine())
    shared = predict(SPEC, cand, B, _hand_machine(cores=0.5, cpus=2, gil=True))
    assert shared.microbatches == 1 and shared.bubble_fraction < 0.45
    why = shared.bubble_why
    book = "where the textbook (p-1)/(m+p-1) = 1/2 = 50.0% for p = 2 stages, m = 1 microbatch per replica"
    assert why.startswith(f"bubble {shared.bubble_fraction:.1%}, {book}")
    assert "share this machine's cores" in why
    if abs(alone.bubble_fraction - 0.5) <= 0.005:
        assert alone.bubble_why == ""
    else:  # the hand machine's 1 ms point-to-point sends
        assert "schedule simulated" in alone.bubble_why
