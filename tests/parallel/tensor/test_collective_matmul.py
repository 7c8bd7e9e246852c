"""Collective matmul: the overlapped sequence-parallel layers equal the plain ones (the same products,
the same ring reduction order: at most a dot product's rounding apart, where BLAS picks another
kernel for a block of rows), send exactly the unfused collectives' bytes, overlap on the
timeline under an emulated link, and refuse what they can't do. Run as a program under
``mpirun -n 2`` (``python test_collective_matmul.py``) it checks the same on real processes."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist import trace
from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.comm import measure, run
from minidist.comm.transports.link import set_link
from minidist.nn import GPTConfig
from minidist.parallel.tensor.collective_matmul import all_gather_matmul, use_collective_matmul
from minidist.parallel.tensor.gpt import TPGPT
from minidist.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

ROOT = Path(__file__).resolve().parents[3]


def mlp_rank(comm, x, g, hidden, overlap, bias=True):
    """Column -> GELU -> row, sequence parallel, on this rank's sequence shard of x; the output, every
    gradient, and the ledger's bytes and messages of forward + backward."""
    dim = x.shape[-1]
    kw = dict(sequence_parallel=True, dtype=x.dtype, bias=bias)
    col = ColumnParallelLinear(dim, hidden, comm, rng=np.random.default_rng(1), **kw)
    row = RowParallelLinear(hidden, dim, comm, rng=np.random.default_rng(2), **kw)
    if overlap:
        assert use_collective_matmul(col) == use_collective_matmul(row) == 1
    t = x.shape[1] // comm.size
    mine = slice(comm.rank * t, (comm.rank + 1) * t)
    xs = Tensor(np.ascontiguousarray(x[:, mine]), requires_grad=True)
    with measure(comm) as m:
        y = row(ops.gelu(col(xs)))
        (y * Tensor(np.ascontiguousarray(g[:, mine]))).sum().backward()
    grads = [xs.grad, col.weight.grad, row.weight.grad] + ([col.bias.grad] if bias else [])
    return y.numpy(), grads, (m.bytes_sent, m.messages)


def assert_same_products(got, want, k: int):
    """Equal up to the rounding of a length-k dot product computed in two orders: BLAS may pick another
    kernel (another order) for a block of rows than for the whole matrix -- one row is a gemv -- so the
    stated bound is 2·k·u of the array's scale, k the longest contraction on its path. (Everything
    else, the ring reduction order included, is the plain layers' own.)"""
    u = np.finfo(want.dtype).eps / 2
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * k * u * max(1.0, float(np.abs(want).max())))


@settings(max_examples=20, deadline=None)
@given(tp=st.integers(2, 4), b=st.integers(1, 3), t_per_rank=st.integers(1, 3), dim=st.sampled_from([3, 8]),
       hidden_per_rank=st.integers(1, 4), bias=st.booleans(), dtype=st.sampled_from(["float64", "float32"]))
def test_overlapped_layers_equal_plain_layers(tp, b, t_per_rank, dim, hidden_per_rank, bias, dtype):
    rng = np.random.default_rng(tp * 100 + b)
    x = rng.standard_normal((b, tp * t_per_rank, dim)).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    kw = dict(x=x, g=g, hidden=tp * hidden_per_rank, bias=bias)
    plain, fused = run(mlp_rank, ranks=tp, overlap=False, **kw), run(mlp_rank, ranks=tp, overlap=True, **kw)
    k = 2 * (dim + tp * hidden_per_rank + b * tp * t_per_rank)  # the products on each result's path
    for (y0, g0, led0), (y1, g1, led1) in zip(plain, fused):
        assert_same_products(y1, y0, k)
        for a, c in zip(g1, g0):
            assert_same_products(a, c, k)
        assert led1 == led0  # the ledger: the unfused all-gathers' and reduce-scatters' bytes and messages


def test_bytes_are_the_ring_formula():
    """Forward + backward of column -> row: 4 ring collectives (2 all-gathers, 2 reduce-scatters) of the
    (b, T, h) activation: 4·(p-1)/p·b·T·h·itemsize bytes, 4·(p-1) messages per rank."""
    b, t, h, p = 2, 8, 4, 4
    x = np.ones((b, t, h))
    res = run(mlp_rank, ranks=p, x=x, g=x, hidden=8, overlap=True, bias=False)  # (no bias all-reduce)
    for _, _, (sent, msgs) in res:
        assert sent == 4 * 3 * 2 * 2 * 4 * 8 and msgs == 4 * 3  # 4 · (p-1) · (b·T/p·h) · 8 bytes


def test_tp_gpt_with_collective_matmul_equals_plain_tp_gpt():
    cfg = GPTConfig(vocab_size=8, block_size=8, n_layer=2, n_head=4, d_model=16, dtype="float64", seed=3)
    idx = np.random.default_rng(0).integers(0, 8, (2, 8))

    def rank(comm, overlap):
        model = TPGPT(cfg, comm, sequence_parallel=True)
        switched = use_collective_matmul(model, overlap)
        loss = model.loss(idx, idx)
        loss.backward()
        return switched, loss.item(), [p.grad for p in model.parameters()]

    plain, fused = run(rank, ranks=2, overlap=False), run(rank, ranks=2, overlap=True)
    for (n, l0, g0), (_, l1, g1) in zip(plain, fused):
        assert n == 2 * 4 + 1  # qkv, attn proj, fc, mlp proj per block, and the LM head
        assert l1 == pytest.approx(l0, rel=1e-13, abs=0)
        for a, c in zip(g1, g0):
            assert_same_products(a, c, 4 * 16 * 8)


def _traced(comm, x):
    tracer = trace.Tracer(comm.rank)
    col = ColumnParallelLinear(x.shape[-1], 64, comm, sequence_parallel=True, dtype=x.dtype,
                               rng=np.random.default_rng(0))
    use_collective_matmul(col)
    t = x.shape[1] // comm.size
    with trace.tracing(tracer):
        y = col(Tensor(np.ascontiguousarray(x[:, comm.rank * t:(comm.rank + 1) * t])))
    return y.numpy(), tracer.events, comm.async_worker is not None


def test_under_an_emulated_link_hops_run_beside_the_compute():
    """With a link, each hop runs on the async worker thread (the compute thread never sleeps for
    it): p-1 'send' spans per rank, each at least the link's delay, and the result unchanged."""
    x = np.random.default_rng(0).standard_normal((2, 8, 16))
    plain = run(_traced, ranks=2, x=x)
    previous = set_link("alpha_us=200,gbps=10")
    try:
        linked = run(_traced, ranks=2, x=x)
    finally:
        set_link(previous)
    assert not any(r[2] for r in plain) and all(r[2] for r in linked)
    for (y0, _, _), (y1, events, _) in zip(plain, linked):
        np.testing.assert_array_equal(y1, y0)
        sends = [e for e in events if e["cat"] == "send"]
        computes = [e for e in events if e["cat"] == "compute"]
        assert len(sends) == 1 and len(computes) == 2
        assert sends[0]["t1"] - sends[0]["t0"] >= 200e-6  # it paid the link


def test_bad_input_is_refused_clearly():
    def no_sp(comm):
        use_collective_matmul(ColumnParallelLinear(4, 4, comm))

    with pytest.raises(ValueError, match="collective_matmul=True .*sequence_parallel=True"):
        run(no_sp, ranks=2)

    def plain_model(comm):
        cfg = GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, d_model=8)
        use_collective_matmul(TPGPT(cfg, comm))

    with pytest.raises(ValueError, match="no sequence-parallel"):
        run(plain_model, ranks=2)

    def bad_shape(comm):
        all_gather_matmul(Tensor(np.ones((2, 3))), Tensor(np.ones((3, 4))), None, comm)

    with pytest.raises(ValueError, match=r"x of shape \(batch, sequence, 3\)"):
        run(bad_shape, ranks=2)

    def half(comm):
        x, w = np.ones((1, 2, 3), np.float16), np.ones((3, 4), np.float16)
        all_gather_matmul(Tensor(x), Tensor(w), None, comm)

    with pytest.raises(ValueError, match=r"with float16 weights is not built"):
        run(half, ranks=2)


# -- under real mpirun ---------------------------------------------------------------------------------

def check_under_mpi(comm):
    """tp=2 as real processes: the overlapped layers equal the plain ones, bytes equal too."""
    assert comm.transport == "mpi" and comm.size == 2, (comm.transport, comm.size)
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((2, 6, 8)), rng.standard_normal((2, 6, 8))
    y0, g0, led0 = mlp_rank(comm, x, g, 8, overlap=False)
    y1, g1, led1 = mlp_rank(comm, x, g, 8, overlap=True)
    for a, c in zip([y1] + g1, [y0] + g0):
        assert_same_products(a, c, 2 * (8 + 8 + 12))
    assert led0 == led1
    print(f"OK rank {comm.rank} bytes {led1[0]}", flush=True)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
def test_overlapped_layers_equal_plain_under_mpirun():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    cmd = ["mpirun", "-n", "2", sys.executable, str(Path(__file__))]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(int(r) for r in re.findall(r"OK rank (\d+)", res.stdout)) == [0, 1], res.stdout


if __name__ == "__main__":
    run(check_under_mpi)


def test_lesson_overlap_flag_passes_and_bad_link_is_refused_before_ranks_start(capsys):
    from minidist.lessons import tensor_parallel

    with pytest.raises(SystemExit) as e:
        tensor_parallel.main(["--ranks", "2", "--overlap", "--link", "bogus"])
    assert e.value.code == 2
    assert "error: argument --link: link spec 'bogus'" in capsys.readouterr().err
    tensor_parallel.main(["--ranks", "2", "--overlap", "--steps", "2", "--seq", "8", "--d-model", "16",
                          "--layers", "1", "--batch", "2"])
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("PASS") >= 4 and "CM: 8 rings of collective matmul hops" in out
