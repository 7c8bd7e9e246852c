"""Grader for exercises/three_d.py: the capstone, dp x pp x tp training == the serial twin.

``mesh_coordinates`` and ``loss_weights`` are checked against the formulas written out here;
``train_3d`` trains a tiny float64 GPT for 2 steps on several meshes of up to 8 thread ranks, with
some targets ignored, and its gathered parameters and losses must match ``train_serial`` (1e-9).
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.comm import Mesh
from minidist.grading import RanksHung, run_guarded, untouched
from minidist.nn import GPTConfig
from minidist.nn.optim import make_optimizer
from minidist.nn.serial import max_state_diff, train_serial
from minidist.parallel import three_d as T
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.partition import partition_uniform
from minidist.parallel.pipeline.runtime import run_schedule, split_microbatches
from minidist.parallel.pipeline.stage import PipelineStage

GRADE = settings(max_examples=15, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, d_model=8, dtype="float64")
TOL = 1e-9  # float64: only the summation order differs (microbatch and replica partial sums)
MESHES = [(2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 1), (2, 2, 2, 2)]  # dp, pp, tp, microbatches
WAIT_S = 20


def check_mesh_coordinates(impl):
    @GRADE
    @given(dp=st.integers(1, 3), pp=st.integers(1, 3), tp=st.integers(1, 3))
    @example(dp=2, pp=2, tp=2)
    def prop(dp, pp, tp):
        for pr in range(pp):
            for dr in range(dp):
                for tr in range(tp):
                    rank = (pr * dp + dr) * tp + tr
                    got = tuple(int(v) for v in impl.mesh_coordinates(rank, dp, pp, tp))
                    call = f"mesh_coordinates(rank {rank}, dp={dp}, pp={pp}, tp={tp}) = {got}"
                    assert got == (dr, pr, tr), f"{call}, expected (dp, pp, tp ranks) {(dr, pr, tr)}"
    prop()


def check_loss_weights(impl):
    @GRADE
    @given(dp=st.integers(1, 4), ys=st.lists(st.lists(st.integers(-1, 3), min_size=1, max_size=4),
                                             min_size=1, max_size=4), others=st.integers(0, 9))
    @example(dp=2, ys=[[0, -1, 2], [-1, -1, 1]], others=3)
    @example(dp=1, ys=[[-1]], others=0)  # nothing valid anywhere: weights 0, not a division by zero
    def prop(dp, ys, others):
        ys = [np.array(y) for y in ys]
        n_total = sum(int((y != -1).sum()) for y in ys) + others
        want = [dp * int((y != -1).sum()) / n_total if n_total else 0.0 for y in ys]
        got = [float(w) for w in untouched(impl.loss_weights)(ys, n_total, dp)]
        assert np.allclose(got, want, rtol=1e-12, atol=0), (
            f"loss_weights(valid targets per microbatch {[int((y != -1).sum()) for y in ys]}, "
            f"n_total={n_total}, dp={dp}) = {got}, expected dp * n_j / n_total = {want}")
    prop()


def _batches(rows, steps=2, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x, y = rng.integers(0, 16, (rows, 4)), rng.integers(0, 16, (rows, 4))
        y[rng.random(y.shape) < 0.3] = -1  # ignored targets: microbatches hold different counts
        out.append((x, y))
    return out


def check_train_3d(impl):
    for dp, pp, tp, m in MESHES:
        batches = _batches(dp * m * 2)
        want, want_losses = train_serial(CFG, batches, lr=0.1)
        what = f"dp={dp} x pp={pp} x tp={tp} ({dp * pp * tp} ranks), {m} microbatches, 2 SGD steps"

        def body(comm, batches=batches, dp=dp, pp=pp, tp=tp, m=m):
            mesh, stage = untouched(impl.train_3d)(comm, CFG, batches, dp, pp, tp, m, 0.1)
            return T.gather_full_state(comm, types.SimpleNamespace(mesh=mesh, stage=stage))
        try:
            state = run_guarded(body, dp * pp * tp, WAIT_S)[0]
        except RanksHung as e:
            raise AssertionError(f"{what}: the ranks hung: {e}") from None
        assert state is not None and state.keys() == want.keys(), (
            f"{what}: the gathered model has parameters {sorted(state or {})[:4]}..., "
            f"expected {sorted(want)[:4]}...")
        worst = max(want, key=lambda k: max_state_diff({k: state[k]}, {k: want[k]}))
        diff = max_state_diff({worst: state[worst]}, {worst: want[worst]})
        assert diff <= TOL, (f"{what}: parameter {worst} differs from the serial twin's by {diff:.3g} "
                             f"(tolerance {TOL}); serial losses {np.round(want_losses, 6).tolist()}")


CHECKS = {"mesh_coordinates": check_mesh_coordinates, "loss_weights": check_loss_weights,
          "train_3d": check_train_3d}
POINTS = {"mesh_coordinates": 1, "loss_weights": 2, "train_3d": 5}


# -- minidist's own answer (must pass) -------------------------------------------------------------

def _coords(rank, dp, pp, tp):
    return (rank // tp) % dp, rank // (tp * dp), rank % tp


def _weights(ys, n_total, dp):
    return T.token_loss_weights(ys, n_total, dp) if n_total else [0.0] * len(ys)


def _train(comm, cfg, batches, dp, pp, tp, microbatches, lr):
    result = T.train_3d(comm, cfg, batches, dp=dp, pp=pp, tp=tp, microbatches=microbatches, lr=lr)
    return result.mesh, result.stage


def reference():
    return types.SimpleNamespace(mesh_coordinates=_coords, loss_weights=_weights, train_3d=_train)


# -- deliberately broken implementations (must fail) -----------------------------------------------

def _coords_dp_fastest(rank, dp, pp, tp):  # the dp index varies fastest: tp groups are not adjacent
    return rank % dp, rank // (dp * tp), (rank // dp) % tp


def _weights_one_over_m(ys, n_total, dp):  # the mean of microbatch means: wrong when counts differ
    return [1.0 / len(ys)] * len(ys)


def _weights_no_dp(ys, n_total, dp):  # forgets that DDP divides by dp
    return [int((np.asarray(y) != -1).sum()) / n_total if n_total else 0.0 for y in ys]


def _train_with(weights=None, ddp=True, rows="mine"):
    def train(comm, cfg, batches, dp, pp, tp, microbatches, lr):
        mesh = Mesh(comm, dp=dp, pp=pp, tp=tp)
        model, loss_fn = T.build_model(cfg, mesh.tp)
        stage = PipelineStage(model, partition_uniform(len(model), pp), mesh.pp_rank, pp, loss_fn=loss_fn)
        opt = make_optimizer("sgd", stage.parameters(), lr)
        sync = DistributedDataParallel(stage, mesh.dp, broadcast_from=None) if dp > 1 and ddp else None

        def step():
            if sync is not None:
                sync.wait_gradients()
            opt.step()
            opt.zero_grad()
        n = batches[0][0].shape[0] // dp
        for x, y in batches:
            sl = slice(mesh.dp_rank * n, (mesh.dp_rank + 1) * n) if rows == "mine" else slice(0, n)
            xs, ys = split_microbatches(x[sl], microbatches), split_microbatches(y[sl], microbatches)
            w = (weights or _weights)(ys, int((y != -1).sum()), dp)
            run_schedule(stage, mesh.pp, make_schedule("1f1b", pp, microbatches)[mesh.pp_rank], xs, ys, step,
                         ddp=sync, loss_weights=w)
        return mesh, stage
    train.__name__ = f"train_weights_{getattr(weights, '__name__', 'right')}_ddp{ddp}_rows_{rows}"
    return train


BROKEN = {"mesh_coordinates": [_coords_dp_fastest],
          "loss_weights": [_weights_one_over_m, _weights_no_dp],
          "train_3d": [_train_with(weights=_weights_one_over_m), _train_with(ddp=False),
                       _train_with(rows="first")]}
