"""Bad input fails early: every lesson flag and public constructor refuses out-of-range values with a
clear error naming the argument, raised by minidist itself -- never a hang, a silent run, or a
traceback that ends inside NumPy."""

import contextlib
import importlib
import io
import math
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.infer import Request, SamplingParams, generate, serve
from minidist.nn import GPT, GPTConfig, Linear, optim
from minidist.nn.data import BatchLoader, SyntheticTask, TextDataset
from minidist.parallel.memory.offload import OffloadedAdamW
from tests.conftest import budget

ROOT = Path(__file__).resolve().parents[1]

# -- lesson command lines: argparse errors (exit status 2) naming the flag --------------------------

# flags that must be integers >= 1, per lesson (written out here, not read from the parsers)
POSITIVE_INT_FLAGS = {
    "data_parallel": ["--ranks", "--steps", "--batch", "--accum", "--seq", "--d-model", "--layers",
                      "--bucket-kb", "--overlap-rows"],
    "pipeline": ["--ranks", "--microbatches", "--steps", "--batch", "--dp", "--pp", "--tp", "--seq",
                 "--layers", "--width"],
    "tensor_parallel": ["--ranks", "--steps", "--batch", "--seq", "--d-model", "--layers"],
    "checkpointing": ["--ranks", "--layers", "--dim", "--seq", "--batch", "--repeats"],
    "mixed_precision": ["--ranks", "--layers", "--dim", "--seq", "--batch", "--steps"],
    "offload": ["--ranks", "--layers", "--dim", "--seq", "--batch", "--steps", "--shard-kib"],
    "inference": ["--ranks", "--steps", "--block", "--layers", "--heads", "--d-model", "--batch"],
    "allreduce": ["--ranks", "--repeats"],
    "train": ["--steps", "--batch", "--block", "--layers", "--d-model", "--heads"],
}
# flags that must be finite numbers > 0
POSITIVE_FLOAT_FLAGS = {"data_parallel": ["--lr"], "pipeline": ["--lr"], "tensor_parallel": ["--lr", "--tol"],
                        "mixed_precision": ["--lr"], "offload": ["--lr"], "train": ["--lr"]}

INT_FLAG = st.sampled_from([(m, f) for m, fs in POSITIVE_INT_FLAGS.items() for f in fs])
FLOAT_FLAG = st.sampled_from([(m, f) for m, fs in POSITIVE_FLOAT_FLAGS.items() for f in fs])
BAD_INT = st.one_of(st.integers(max_value=0).map(str), st.sampled_from(["1.5", "two", "", "nan"]))
BAD_FLOAT = st.one_of(st.floats(max_value=0.0, allow_nan=False).map(repr),
                      st.sampled_from(["nan", "inf", "-inf", "NaN", "abc"]))


def cli_error(module: str, argv: list) -> str:
    """Run lesson ``module``'s main(argv) in-process; it must stop with an argparse error (exit 2)
    before any rank starts (nothing on stdout). Returns stderr."""
    main = importlib.import_module(f"minidist.lessons.{module}").main
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as info, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        main(argv)
    out, err = out.getvalue(), err.getvalue()
    assert info.value.code == 2, (module, argv, err)
    assert out == "", f"{module} {argv} started running before rejecting its arguments"
    return err


@given(INT_FLAG, BAD_INT)
def test_lesson_int_flags_reject_out_of_range(flag, value):
    module, name = flag
    err = cli_error(module, [f"{name}={value}"])
    assert f"argument {name}" in err and ">= 1" in err


@given(FLOAT_FLAG, BAD_FLOAT)
def test_lesson_float_flags_reject_nonfinite_and_nonpositive(flag, value):
    module, name = flag
    err = cli_error(module, [f"{name}={value}"])
    assert f"argument {name}" in err


@given(st.sampled_from(["data_parallel", "pipeline", "checkpointing", "allreduce", "offload"]),
       st.integers(max_value=-1))
def test_negative_seed_is_an_argparse_error(module, seed):
    assert "argument --seed" in cli_error(module, [f"--seed={seed}"])


@pytest.mark.parametrize("module", ["data_parallel", "pipeline", "tensor_parallel", "checkpointing",
                                    "mixed_precision", "offload", "inference", "allreduce"])
@pytest.mark.parametrize("flag", ["--trace", "--plot"])
def test_output_path_in_a_missing_folder_fails_before_training(tmp_path, module, flag):
    path = tmp_path / "no-such-folder" / "out.file"
    err = cli_error(module, ["--ranks", "2", flag, str(path)])
    assert f"argument {flag}" in err and "does not exist" in err
    assert "is a folder" in cli_error(module, ["--ranks", "2", flag, str(tmp_path)])


def test_flags_checked_against_the_model_and_the_world():
    assert "multiple of the 4 attention heads" in cli_error("data_parallel", ["--d-model", "30"])
    assert "multiple of --heads 4" in cli_error("train", ["--d-model", "30"])
    err = cli_error("pipeline", ["--ranks", "8", "--dp", "3"])
    assert "dp=3" in err and "8" in err
    err = cli_error("pipeline", ["--ranks", "2", "--dp", "1", "--batch", "6", "--microbatches", "4"])
    assert "microbatches" in err and "multiple of 4" in err
    assert "--text" in cli_error("train", ["--text", "/no/such/file.txt"])


INTERLEAVED_M2 = ["--ranks", "4", "--dp", "1", "--schedule", "interleaved", "--chunks", "2",
                  "--microbatches", "2"]


def test_pipeline_schedule_rule_is_an_argparse_error_of_one_line():
    """Interleaved 1F1B needs the microbatches to be a multiple of the stages: refused before any rank
    starts (no traceback from each rank), exit 2, one error line under the usage, with a count that works."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    env.pop("MINIDIST_TRANSPORT", None)
    res = subprocess.run([sys.executable, "-m", "minidist.lessons.pipeline", *INTERLEAVED_M2],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 2 and res.stdout == "", (res.returncode, res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("pipeline.py: error: argument --microbatches: "), lines[0]
    assert "multiple of num_stages=4, got 2" in lines[0] and "e.g. --microbatches 4" in lines[0], lines[0]
    assert "4 or 4" not in lines[0]


@pytest.mark.parametrize("argv,flag,alternative", [
    (["--ranks", "4", "--dp", "1", "--schedule", "interleaved", "--microbatches", "6", "--batch", "12"],
     "--microbatches", "--microbatches 4"),          # 4 divides the batch of 12; 8 would not
    (["--ranks", "4", "--dp", "1", "--schedule", "interleaved", "--microbatches", "2", "--batch", "6"],
     "--microbatches", "--microbatches 4 --batch 8"),
    (["--ranks", "2", "--dp", "2", "--schedule", "interleaved"], "--schedule", "--schedule 1f1b --chunks 1"),
])
def test_pipeline_schedule_errors_name_the_flag_and_values_that_run(argv, flag, alternative):
    err = cli_error("pipeline", argv)
    assert f"argument {flag}: " in err and err.rstrip().endswith(f"e.g. {alternative}"), err


def _pipeline_rank_rules(world, dp, pp, tp, schedule, chunks, microbatches, batch, layers):
    """What rank_main enforces, written out: mesh product, stages <= layers, the batch splitting into
    dp x microbatches, heads (4) divisible by tp, interleaved: pp >= 2 and microbatches a multiple of pp."""
    return (dp * pp * tp == world and pp * chunks <= layers + 2 and batch % (dp * microbatches) == 0
            and 4 % tp == 0 and (schedule != "interleaved" or (pp >= 2 and microbatches % pp == 0)))


@budget(60)
@given(dp=st.integers(1, 3), pp=st.integers(1, 4), tp=st.sampled_from([1, 2, 3]),
       schedule=st.sampled_from(["gpipe", "1f1b", "interleaved"]), microbatches=st.integers(1, 8),
       rows=st.integers(1, 3), layers=st.integers(1, 4), give_pp=st.booleans(),
       off=st.sampled_from([(0, 0)] * 3 + [(1, 0), (0, 1), (-1, 0), (0, -1)]))
def test_pipeline_flags_the_ranks_would_reject_are_rejected_in_main(dp, pp, tp, schedule, microbatches, rows,
                                                                    layers, give_pp, off):
    """Whatever main lets through, every rank accepts; whatever a rank would refuse, main refuses first.
    Mostly a world of dp x pp x tp ranks and a batch of dp x microbatches x rows (``off`` shifts one)."""
    from minidist.lessons import pipeline as lesson

    ranks, batch = max(1, dp * pp * tp + off[0]), max(1, dp * microbatches * rows + off[1])
    started = []
    argv = [f"--ranks={ranks}", f"--dp={dp}", f"--tp={tp}", f"--schedule={schedule}",
            f"--microbatches={microbatches}", f"--batch={batch}", f"--layers={layers}", "--width=16"]
    argv += [f"--pp={pp}"] if give_pp else []
    chunks = 2 if schedule == "interleaved" else 1
    stages = pp if give_pp else max(1, ranks // (dp * tp))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lesson, "launch", lambda fn, args: started.append(args))
        if _pipeline_rank_rules(ranks, dp, stages, tp, schedule, chunks, microbatches, batch, layers):
            lesson.main(argv)
            assert len(started) == 1, argv
        else:
            err = cli_error("pipeline", argv)
            assert not started and "error: " in err, argv


def test_interleaved_hint_names_a_count_that_works():
    from minidist.parallel.pipeline.schedule import interleaved_1f1b

    assert "use 4 microbatches (or another multiple of 4)" in str(raises_clearly(
        lambda: interleaved_1f1b(4, 2, 2), "multiple of num_stages=4, got 2"))
    raises_clearly(lambda: interleaved_1f1b(4, 9, 2), "got 9; use 8 or 12 microbatches")


@pytest.mark.timeout(60)  # it deadlocked: a regression must fail here, not wait for the watchdog
@pytest.mark.parametrize("ranks,batch,empty,need", [(4, 2, "[2, 3]", 4), (3, 2, "[1]", 3), (8, 7, "[4]", 8)])
def test_data_parallel_refuses_ranks_without_rows(ranks, batch, empty, need):
    """It deadlocked: a rank with no rows never joins the gradient all-reduce."""
    err = cli_error("data_parallel", ["--ranks", str(ranks), "--batch", str(batch)])
    assert f"rank(s) {empty} no rows" in err and f"--batch >= {need}" in err


# -- public APIs: ValueError/TypeError raised by minidist, naming the argument -------------------------

def raises_clearly(fn, *words, kinds=(ValueError, TypeError)):
    """``fn()`` raises one of ``kinds`` from minidist's own code (the last frame is not NumPy's),
    with every one of ``words`` in the message."""
    with pytest.raises(kinds) as info:
        fn()
    last = traceback.extract_tb(info.value.__traceback__)[-1].filename
    assert "/minidist/" in last and "/numpy/" not in last, f"raised from {last}: {info.value}"
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    return info.value


CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8, dtype="float64")
MODEL = GPT(CFG)


@given(st.sampled_from(["vocab_size", "block_size", "n_layer", "n_head", "d_model"]),
       st.one_of(st.integers(max_value=0), st.sampled_from([2.5, "4", None, True])))
def test_gpt_config_sizes(field, value):
    raises_clearly(lambda: CFG.replace(**{field: value}), f"GPTConfig.{field}")


@given(st.sampled_from(["int32", "int64", "uint8", "bool", "complex128", "str", "bogus"]))
def test_gpt_config_dtype_must_be_float(dtype):
    raises_clearly(lambda: CFG.replace(dtype=dtype), "GPTConfig.dtype", "float")


@given(st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.0), st.just(math.nan)))
def test_gpt_config_dropout(p):
    raises_clearly(lambda: CFG.replace(dropout=p), "GPTConfig.dropout", "[0, 1)")


@given(st.sampled_from([optim.AdamW, optim.SGD]),
       st.one_of(st.floats(max_value=-1e-12), st.sampled_from([math.nan, math.inf, -math.inf])))
def test_optimizer_lr_must_be_finite_and_nonnegative(cls, lr):
    raises_clearly(lambda: cls(MODEL.parameters(), lr=lr), "lr", "finite")


@given(st.sampled_from([("betas", (0.9, 1.0)), ("betas", (math.nan, 0.999)), ("eps", 0.0),
                        ("eps", -1e-8), ("weight_decay", math.inf), ("weight_decay", -0.1)]))
def test_adamw_hyperparameters(kw):
    name, value = kw
    raises_clearly(lambda: optim.AdamW(MODEL.parameters(), **{name: value}), name.split("[")[0])


INT64 = 2**63


@given(st.integers(-INT64, -1) | st.integers(CFG.vocab_size, INT64 - 1), st.integers(0, 1), st.integers(0, 3))
def test_input_ids_out_of_range(bad, row, col):
    x = np.zeros((2, 4), np.int64)
    x[row, col] = bad
    raises_clearly(lambda: MODEL.loss(x, np.zeros_like(x)), str(bad), f"[0, {CFG.vocab_size})")


@given(st.integers(min_value=-2**63, max_value=-2) | st.integers(min_value=CFG.vocab_size, max_value=10**6),
       st.integers(0, 7))
def test_targets_out_of_range_other_than_ignore(bad, pos):
    x = np.zeros((2, 4), np.int64)
    y = np.full((2, 4), -1)  # -1: the documented ignore value, accepted
    y.flat[pos] = bad
    raises_clearly(lambda: MODEL.loss(x, y), str(bad), "-1 (ignored)")


def test_ignore_value_and_full_range_still_accepted():
    x = np.array([[0, CFG.vocab_size - 1, 3]])
    y = np.array([[-1, CFG.vocab_size - 1, 0]])
    assert np.isfinite(MODEL.loss(x, y).item())


@given(st.sampled_from([(1, 0), (0, 3), (0, 0), (3,), (1, 2, 3)]))
def test_empty_or_misshapen_input(shape):
    raises_clearly(lambda: MODEL(np.zeros(shape, np.int64)), "shape", str(tuple(shape)))


def test_float_token_ids_are_a_type_error():
    raises_clearly(lambda: MODEL(np.zeros((1, 3))), "integer", kinds=TypeError)


@given(st.integers(max_value=-1))
def test_generate_negative_max_new_tokens(n):
    raises_clearly(lambda: generate(MODEL, [[1, 2]], n), "max_new_tokens", ">= 0")


@given(st.sampled_from([math.nan, math.inf, -1.0, -1e-9]))
def test_sampling_temperature(t):
    raises_clearly(lambda: SamplingParams(temperature=t), "temperature")


@pytest.mark.timeout(30)  # it spun forever: a regression must fail here, not hang the suite
@pytest.mark.parametrize("name", ["max_batch", "block_len", "num_blocks"])
@pytest.mark.parametrize("value", [0, -1, -1000])
def test_serve_sizes_must_be_positive(name, value):
    """``max_batch=0`` spun forever. (Not a hypothesis test: hypothesis would retry the example the
    timeout interrupted, and spin again.)"""
    kw = {"cache": "paged"} if name != "max_batch" else {}
    raises_clearly(lambda: serve(MODEL, [Request(0, [1, 2], 3)], **{name: value}, **kw), name, ">= 1")


@given(st.integers(max_value=-1))
def test_serve_request_negative_max_new_tokens(n):
    raises_clearly(lambda: serve(MODEL, [Request(7, [1, 2], n)]), "request 7", "max_new_tokens")


@given(st.sampled_from([("batch_size", 0), ("batch_size", -2), ("batch_size", 2.0), ("seed", -1)]))
def test_batch_loader(kw):
    data = TextDataset(np.arange(50) % 7, block_size=4)
    name, value = kw
    args = {"batch_size": 2, name: value}
    raises_clearly(lambda: BatchLoader(data, **args), f"BatchLoader: {name}")


@given(st.sampled_from([("length", 0), ("size", -1), ("length", 1.5)]))
def test_synthetic_task(kw):
    raises_clearly(lambda: SyntheticTask("copy", **dict([kw])), f"SyntheticTask: {kw[0]}")


def test_text_dataset_block_size():
    raises_clearly(lambda: TextDataset(np.arange(50), block_size=0), "TextDataset: block_size")


@given(st.integers(max_value=-1))
def test_offload_shard_bytes(n):
    params = Linear(4, 2, rng=np.random.default_rng(0)).parameters()
    raises_clearly(lambda: OffloadedAdamW(params, where="host", shard_bytes=n), "shard_bytes")


@given(st.sampled_from([("psi", -1), ("n", 0), ("n", 2.0), ("k_bytes", -8)]))
def test_zero_formula_sizes(kw):
    from minidist.nn.footprint import zero_formula

    args = {"stage": 1, "psi": 100, "n": 4} | dict([kw])
    raises_clearly(lambda: zero_formula(**args), f"zero_formula: {kw[0]}")


@given(st.sampled_from([math.nan, math.inf, 0.0, -1.0]))
def test_clip_grad_norm_max_norm(max_norm):
    raises_clearly(lambda: optim.clip_grad_norm(MODEL.parameters(), max_norm), "max_norm")


@given(st.sampled_from([{"warmup": -1, "total": 10}, {"warmup": 2, "total": 0}, {"warmup": 1.5, "total": 10},
                        {"warmup": 2, "total": 10, "min_ratio": math.nan}]))
def test_warmup_cosine(kw):
    opt = optim.SGD(MODEL.parameters(), lr=0.1)
    raises_clearly(lambda: optim.WarmupCosine(opt, **kw), "WarmupCosine")
