"""Helpers shared by the planner's tests: a tiny GPT and its ModelSpec, and the check that a mesh's
measured calls, bytes and memory equal the planner's."""

from collections import Counter

import numpy as np

from minidist.comm import measure, run
from minidist.nn.footprint import MemoryAccountant
from minidist.nn.gpt import GPTConfig
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.memory.recompute import recompute_stage
from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.runtime import run_schedule, split_microbatches
from minidist.parallel.pipeline.stage import PipelineStage
from minidist.parallel.three_d import build_model, make_optimizer, train_3d
from minidist.plan.mesh import Candidate, Settings, memory, stage_activation_peak, stage_param_counts
from minidist.plan.model import ModelSpec
from minidist.plan.traffic import THREADS, collectives

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, d_model=16)


SPEC = ModelSpec("tiny", n_layer=2, d_model=16, n_head=4, vocab=32, seq=8, engine="minidist", dtype_bytes=4)


B = 8


def batches(n=2):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 32, (B, 8)), rng.integers(0, 32, (B, 8))) for _ in range(n)]


def measured_3d(dp, tp, pp, m, checkpoint=None, cfg=CFG, chunks=1, schedule=None):
    """Per rank: (its ledger calls in step 2 as a Counter of (name, bytes), total bytes sent in step 2,
    peak activations of step 2, MemoryAccountant report at the optimizer step of one more step)."""
    data = batches()
    schedule = schedule or ("interleaved" if chunks > 1 else "1f1b")

    def body(comm):
        marks = []
        with measure(comm) as meas:
            def on_step(step, stats):
                marks.append((len(meas.calls), comm.ledger.bytes_sent))
            res = train_3d(comm, cfg, data, dp=dp, pp=pp, tp=tp, microbatches=m, on_step=on_step,
                           schedule=schedule, chunks=chunks,
                           optimizer="adamw", lr=1e-3, checkpoint=checkpoint)
            calls = meas.calls[marks[0][0]:marks[1][0]]
        # one more step, as train_3d runs it, reading the accountant where the state is largest:
        # at the optimizer step, gradients complete, AdamW's moments allocated
        mesh = res.mesh
        model, loss_fn = build_model(cfg, mesh.tp)
        stage = PipelineStage(model, res.bounds, mesh.pp_rank, pp, loss_fn=loss_fn)
        for chunk in stage.chunks if checkpoint is not None else ():  # as parallelize recomputes a stage
            recompute_stage(chunk, checkpoint)
        ddp = DistributedDataParallel(stage, mesh.dp, broadcast_from=None) if dp > 1 else None
        opt = make_optimizer("adamw", stage.parameters(), 1e-3)
        reports = []

        def step():
            if ddp is not None:
                ddp.wait_gradients()
            opt.step()
            reports.append(MemoryAccountant().report(stage, opt))
        rows = slice(mesh.dp_rank * B // dp, (mesh.dp_rank + 1) * B // dp)
        x, y = data[0]
        sched = make_schedule(schedule, pp, m, chunks)
        run_schedule(stage, mesh.pp, sched[mesh.pp_rank],
                     split_microbatches(x[rows], m), split_microbatches(y[rows], m), step, ddp=ddp)
        where = (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank)
        return where, Counter((c.name, c.bytes_sent) for c in calls), marks[1][1] - marks[0][1], \
            res.stats[1].peak_activation_bytes, reports[0]

    return run(body, ranks=dp * tp * pp)


def check_mesh(dp, tp, pp, m, checkpoint, cfg, spec, chunks=1, schedule="1f1b", where=THREADS):
    """Every rank's ledger calls, bytes, state and activation peak == the planner's prediction
    (`where`: the transport the ranks run on; under mpirun each process checks its own rank)."""
    cand = Candidate(dp=dp, tp=tp, pp=pp, microbatch_size=B // (dp * m), checkpoint=checkpoint or "none",
                     schedule=schedule, chunks=chunks)
    for (stage, dpr, tpr), calls, sent, peak, rep in measured_3d(dp, tp, pp, m, checkpoint, cfg, chunks,
                                                                 schedule):
        pred = collectives(spec, cand, B, stage, dp_rank=dpr, tp_rank=tpr, where=where)  # every rank
        want = Counter()
        for c in pred:
            if c.axis != "pp":
                want[(c.name, int(c.sent))] += c.count
        assert calls == want, f"stage {stage}: ledger {calls} != planner {want}"
        assert sent == sum(c.sent * c.count for c in pred), f"stage {stage}: total bytes"
        mem = memory(spec, cand, B, Settings("adamw"))
        # the fullest stage is what memory() reports; compare stage by stage through a 1-stage view
        mine = stage_memory(spec, cand, stage)
        assert (rep["params"], rep["grads"], rep["optimizer_state"]) == \
            (mine["params"], mine["grads"], mine["optimizer"]), f"stage {stage}: {rep} vs {mine}"
        assert peak == mine["activations"], f"stage {stage}: activations {peak} vs {mine['activations']}"
        assert mem["total"] >= mine["total"]


def stage_memory(spec, cand, stage):
    n, _ = stage_param_counts(spec, cand, stage)
    act = stage_activation_peak(spec, cand, B, stage, Settings(), recompute=False)
    return {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "activations": act, "total": 16 * n + act}
