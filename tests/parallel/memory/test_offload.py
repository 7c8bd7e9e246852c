"""Offloaded AdamW: bit-identical to in-memory AdamW; clear errors; nothing left behind."""

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.nn.module import Parameter
from minidist.nn.optim import AdamW
from minidist.parallel.memory import offload as offload_mod
from minidist.parallel.memory.offload import OffloadedAdamW
from tests.conftest import backends


def _params(shapes, dtype, seed):
    rng = np.random.default_rng(seed)
    return [Parameter(rng.standard_normal(s).astype(dtype)) for s in shapes]


@given(shapes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 7)), min_size=1, max_size=4),
       dtype=st.sampled_from([np.float32, np.float64]), steps=st.integers(1, 4),
       lr=st.sampled_from([1e-3, 0.1]), wd=st.sampled_from([0.0, 0.01]),
       where=st.sampled_from(["disk", "host"]), prefetch=st.booleans(), seed=st.integers(0, 99),
       shard_bytes=st.sampled_from([0, 200, 1 << 20]), offload_params=st.booleans())
def test_offloaded_adamw_is_bit_identical_to_adamw(tmp_path_factory, shapes, dtype, steps, lr, wd, where,
                                                   prefetch, seed, shard_bytes, offload_params):
    offload_params = offload_params and where == "disk"
    folder = tmp_path_factory.mktemp("off")
    ref, off = _params(shapes, dtype, seed), _params(shapes, dtype, seed)
    opt_ref = AdamW(ref, lr=lr, weight_decay=wd)
    rng = np.random.default_rng(seed + 1)
    with OffloadedAdamW(off, folder, lr=lr, weight_decay=wd, where=where, prefetch=prefetch,
                        shard_bytes=shard_bytes, offload_params=offload_params) as opt:
        for step in range(steps):
            for i, (a, b) in enumerate(zip(ref, off)):
                g = None if (i + step) % 3 == 2 else rng.standard_normal(a.shape).astype(dtype)
                a.grad, b.grad = g, g
            opt_ref.step()
            opt.step()
            for a, b in zip(ref, off):
                np.testing.assert_array_equal(a.data, b.data)
                assert isinstance(b.data, np.memmap) == offload_params
        sd_ref, sd = opt_ref.state_dict(), opt.state_dict()
        for s_ref, s in zip(sd_ref["state"], sd["state"]):
            for k in s_ref:
                np.testing.assert_array_equal(s_ref[k], s[k])
    assert os.listdir(folder) == []  # close() deleted the files


def test_state_dict_moves_between_in_memory_and_offloaded(tmp_path):
    ref, off = _params([(3, 4)], np.float32, 0), _params([(3, 4)], np.float32, 0)
    opt_ref = AdamW(ref, lr=0.1)
    for p in ref:
        p.grad = np.ones(p.shape, np.float32)
    opt_ref.step()
    with OffloadedAdamW(off, tmp_path, lr=0.1) as opt:
        opt.load_state_dict(opt_ref.state_dict())
        off[0].data[...] = ref[0].data
        for p in ref + off:
            p.grad = np.full(p.shape, 0.5, np.float32)
        opt_ref.step()
        opt.step()
        np.testing.assert_array_equal(ref[0].data, off[0].data)


def test_resident_bytes_are_at_most_three_shards_state(tmp_path):
    params = _params([(64, 64)] * 6, np.float32, 0)
    for p in params:
        p.grad = np.ones(p.shape, np.float32)
    one = 2 * 64 * 64 * 4  # m and v of one parameter
    for shard_bytes, shards, resident in ((0, 6, 3 * one), (2 * one, 3, 6 * one), (1 << 30, 1, 6 * one)):
        with OffloadedAdamW(params, tmp_path, shard_bytes=shard_bytes) as opt:
            opt.step()
            assert len(opt.shards) == shards and opt.offloaded_bytes == 6 * one
            assert opt.resident_peak == resident  # updating n, prefetching n+1, writing n-1
    with OffloadedAdamW(params, tmp_path, shard_bytes=0, prefetch=False) as opt:
        opt.step()
        assert opt.resident_peak == one


def test_offloaded_master_weights_leave_compute_memory(tmp_path):
    from minidist.nn.footprint import MemoryAccountant
    from minidist.nn.gpt import GPT, GPTConfig
    from minidist.parallel.memory.precision import MixedPrecision

    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=16)
    idx = np.arange(16).reshape(2, 8)
    runs, masters = [], []
    for offload in (False, True):
        mp = MixedPrecision(GPT(cfg), "bf16")
        opt = (OffloadedAdamW(mp.master_params, tmp_path, lr=1e-2, offload_params=True) if offload
               else AdamW(mp.master_params, lr=1e-2))
        for _ in range(3):
            mp.backward(mp.loss(idx, idx))
            mp.step(opt)
        runs.append([p.data.copy() for p in mp.params])
        masters.append([np.array(m.data) for m in mp.master_params])
        psi = sum(m.size for m in mp.master_params)
        if not offload:  # the control: in-memory AdamW holds fp32 masters and m, v in memory
            report = MemoryAccountant().report(GPT(cfg), opt)
            assert report["optimizer_state"] == 2 * 4 * psi
            continue
        # between steps every master weight *is* a file under tmp_path (no in-memory copy), and the
        # file holds the updated weights: read back from disk, they equal the in-memory run's masters
        for m, want in zip(mp.master_params, masters[0]):
            assert isinstance(m.data, np.memmap), m.name
            path = Path(m.data.filename)
            assert tmp_path in path.parents
            on_disk = np.fromfile(path, dtype=np.float32, count=m.size, offset=m.data.offset)
            np.testing.assert_array_equal(on_disk.reshape(m.shape), want, err_msg=m.name)
        files = [f for f in tmp_path.rglob("*") if f.is_file()]
        assert sum(f.stat().st_size for f in files) == 3 * 4 * psi  # p, m, v in fp32, on disk
        opt.close()
        assert not isinstance(mp.master_params[0].data, np.memmap) and os.listdir(tmp_path) == []
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="offload_params=True needs where='disk'"):
        OffloadedAdamW(_params([(2,)], np.float32, 0), tmp_path, where="host", offload_params=True)


def test_missing_offload_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        OffloadedAdamW(_params([(2,)], np.float32, 0), tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        OffloadedAdamW(_params([(2,)], np.float32, 0), tmp_path / "f")


def test_no_offload_dir_means_a_private_folder_in_the_temp_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(offload_mod.tempfile, "tempdir", str(tmp_path))  # what gettempdir() returns
    with OffloadedAdamW(_params([(2,)], np.float32, 0)) as opt:  # offload_dir=None, where="disk"
        assert os.path.dirname(opt.folder) == str(tmp_path) and len(os.listdir(opt.folder)) == 2
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_offload_dir_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="not writable"):
            OffloadedAdamW(_params([(2,)], np.float32, 0), ro)
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o700)


def test_unwritable_offload_dir_error_even_as_root(tmp_path, monkeypatch):
    monkeypatch.setattr(offload_mod.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match="is not writable by this process"):
        OffloadedAdamW(_params([(2,)], np.float32, 0), tmp_path)
    assert os.listdir(tmp_path) == []


def test_failure_while_creating_files_leaves_nothing_behind(tmp_path, monkeypatch):
    made = []
    real = np.memmap

    def flaky(*a, **k):
        if len(made) == 3:
            raise OSError(28, "No space left on device")
        made.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(offload_mod.np, "memmap", flaky)
    with pytest.raises(OSError, match="No space left"):
        OffloadedAdamW(_params([(4,)] * 4, np.float32, 0), tmp_path)
    assert len(made) == 3 and os.listdir(tmp_path) == []


def test_step_after_close_and_bad_where(tmp_path):
    opt = OffloadedAdamW(_params([(2,)], np.float32, 0), tmp_path)
    opt.close()
    with pytest.raises(RuntimeError, match="after close"):
        opt.step()
    with pytest.raises(ValueError, match="'disk' or 'host'"):
        OffloadedAdamW(_params([(2,)], np.float32, 0), tmp_path, where="gpu")


@pytest.mark.parametrize("backend", backends())
def test_offload_on_every_backend(tmp_path, backend):
    from minidist.accel.backend import get_backend

    be = get_backend(backend)
    ref = [Parameter(be.from_host(a.data)) for a in _params([(3, 5), (4,)], np.float32, 0)]
    off = [Parameter(be.from_host(a.data)) for a in _params([(3, 5), (4,)], np.float32, 0)]
    opt_ref = AdamW(ref, lr=0.1)
    with OffloadedAdamW(off, tmp_path, lr=0.1, where="host") as opt:
        for step in range(3):
            for a, b in zip(ref, off):
                a.grad = b.grad = be.from_host(np.full(a.shape, step - 1.0, np.float32))
            opt_ref.step()
            opt.step()
        for a, b in zip(ref, off):
            np.testing.assert_array_equal(be.to_host(a.data), be.to_host(b.data))


def test_offload_on_jax_updates_each_shard_in_one_compiled_call(tmp_path):
    """On JAX a shard's AdamW step is one ``jax_engine.fused`` call (one per tensor was a dispatch and
    a program per shape each): 5 tensors in 3 shards -> 3 calls a step, bit-identical to AdamW."""
    pytest.importorskip("jax")
    from minidist.accel import jax_engine
    from minidist.accel.backend import get_backend

    if not jax_engine.enabled():
        pytest.skip("the JAX engine is off (MINIDIST_JAX_JIT=0)")
    be = get_backend("jax")
    shapes = [(4, 3), (3,), (4, 3), (3,), (5,)]  # m+v bytes: 96, 24, 96, 24, 40
    ref = [Parameter(be.from_host(a.data)) for a in _params(shapes, np.float32, 1)]
    off = [Parameter(be.from_host(a.data)) for a in _params(shapes, np.float32, 1)]
    opt_ref = AdamW(ref, lr=0.1)
    with OffloadedAdamW(off, tmp_path, lr=0.1, where="host", shard_bytes=120) as opt:
        assert opt.shards == [[0, 1], [2, 3], [4]]
        for step in range(3):
            for i, (a, b) in enumerate(zip(ref, off)):
                a.grad = b.grad = be.from_host(np.full(a.shape, step - 1.0 + i, np.float32))
            opt_ref.step()
            before = jax_engine.STATS["calls:adamw"]
            opt.step()
            assert jax_engine.STATS["calls:adamw"] - before == 3
        for a, b in zip(ref, off):
            np.testing.assert_array_equal(be.to_host(a.data), be.to_host(b.data))


def test_lesson_runs_and_passes(capsys, tmp_path):
    from minidist.lessons import offload

    offload.main(["--ranks", "2", "--dim", "16", "--seq", "8", "--steps", "3",
                  "--offload-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and "FAIL" not in out
    assert os.listdir(tmp_path) == []
