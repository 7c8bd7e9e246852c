"""Checkpoints: bit-identical resume on every mesh, atomic checksummed files, fallback past damaged
checkpoints, clear errors, resharding between meshes, asynchronous two-tier saves."""

import hashlib
import json
import os

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.comm import run
from minidist.lessons.fault_tolerance_job import MeshTrainer, small_config
from minidist.resilience.checkpoint import CheckpointError, load, save
from minidist.resilience.checkpoint.tiers import Checkpointer, Tier
from minidist.resilience.faults import Injector
from tests.conftest import budget

MODES = {  # name: (ranks, MeshTrainer keywords)
    "ddp": (2, {}), "zero1": (2, {"zero": 1}), "zero2": (2, {"zero": 2}), "zero3": (2, {"zero": 3}),
    "tp": (2, {"tp": 2}), "pp": (2, {"pp": 2}), "3d": (8, {"dp": 2, "pp": 2, "tp": 2}),
}


def _job(comm, root, steps, save_at=(), resume=False, dtype="float64", dropout=0.1, full_state=False, **kw):
    """Train to ``steps`` (resuming from ``root`` first if asked), saving after the steps in ``save_at``;
    return the full parameters (or with ``full_state``, parameters and optimizer state) on rank 0."""
    t = MeshTrainer(comm, small_config(dtype, dropout), **kw)
    if resume:
        info = load(comm, root, t.state(), required=True)
        assert t.step_count == info.step
    while t.step_count < steps:
        t.step()
        if t.step_count in save_at:
            save(comm, root, t.step_count, t.state(), keep=3)
    return t.full_state() if full_state else t.full_parameters()


def _equal(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", list(MODES))
def test_resume_in_a_fresh_job_is_bit_identical(tmp_path, mode, dtype):
    n, kw = MODES[mode]
    never_stopped = run(_job, ranks=n, root=str(tmp_path), steps=5, save_at=(3,), dtype=dtype, **kw)[0]
    resumed = run(_job, ranks=n, root=str(tmp_path), steps=5, resume=True, dtype=dtype, **kw)[0]
    assert _equal(resumed, never_stopped)
    fresh = run(_job, ranks=n, root=str(tmp_path), steps=2, dtype=dtype, **kw)[0]  # 2 steps differ from 5
    assert not _equal(fresh, never_stopped)


def _files(d):
    return sorted(os.listdir(d))


@pytest.mark.parametrize("mode", ["ddp", "zero3", "tp", "3d"])
def test_each_element_is_written_once_and_every_file_is_checksummed(tmp_path, mode):
    n, kw = MODES[mode]
    run(_job, ranks=n, root=str(tmp_path), steps=2, save_at=(2,), **kw)
    d = tmp_path / "step-00000002"
    m = json.loads((d / "manifest.json").read_text())
    assert _files(d) == ["manifest.json"] + [f"rank-{r:05d}.bin" for r in range(n)]  # JSON, raw bytes
    for name, meta in m["files"].items():
        blob = (d / name).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == meta["sha256"] and len(blob) == meta["bytes"]
    # parameters + AdamW's m and v, each element once, in float64: 3 x 8 bytes per parameter
    cfg = small_config()
    h, v, T, L = cfg.d_model, cfg.vocab_size, cfg.block_size, cfg.n_layer
    psi = v * h + T * h + L * (4 * h + 3 * h * h + 3 * h + h * h + h + 4 * h * h + 4 * h + 4 * h * h + h) \
        + 2 * h + h * v
    data = dict.fromkeys(m["files"], 0)
    for t in m["tensors"].values():
        for p in t["pieces"]:
            data[p["file"]] += p["nbytes"]
    assert sum(data.values()) == 3 * 8 * psi
    for name, meta in m["files"].items():  # the rest of a file is its trailer: length and magic at the end
        tail = (d / name).read_bytes()[-16:]
        trailer = int.from_bytes(tail[:8], "little")
        assert tail[8:] == b"mdckpt02" and meta["bytes"] == data[name] + trailer + 16
    assert m["step"] == 2 and m["mesh"]["world"] == n
    if mode == "ddp":  # replicated: rank 0 writes everything, rank 1 no piece
        assert data["rank-00001.bin"] == 0


def test_keep_last_k_and_latest_is_replaced_last(tmp_path):
    from minidist.resilience.checkpoint import folder

    folder.claim(str(tmp_path), None)  # minidist's folder (its marker), where earlier saves crashed:
    (tmp_path / "step-00000000.tmp").mkdir()  # a crashed save of an older step: removed
    (tmp_path / "step-00000009.tmp").mkdir()  # a save still being written: kept
    run(_job, ranks=2, root=str(tmp_path), steps=5, save_at=(1, 2, 3, 4, 5))
    assert _files(tmp_path) == [".minidist-checkpoints", "latest", "step-00000003", "step-00000004",
                                "step-00000005", "step-00000009.tmp"]
    assert (tmp_path / "latest").read_text() == "step-00000005"


def _damage(root, how):
    d = root / "step-00000004"
    f = d / "rank-00000.bin"
    if how == "corrupt":
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 1
        f.write_bytes(bytes(b))
    elif how == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    elif how == "missing file":
        f.unlink()
    elif how == "manifest cut":
        m = d / "manifest.json"
        m.write_text(m.read_text()[:200])
    elif how == "latest garbage":
        (root / "latest").write_bytes(b"\x00\xffstep-9")
        return "not a finished checkpoint", 4
    elif how == "half-written":  # a crash mid-save: the temporary directory, and latest still old
        os.rename(d, root / "step-00000004.tmp")
        (root / "latest").write_text("step-00000002")
        return None, 2
    return {"corrupt": "sha256 differs", "truncate": "bytes, the manifest says", "missing file": "missing",
            "manifest cut": "not valid JSON"}[how], 2


@pytest.mark.parametrize("how", ["corrupt", "truncate", "missing file", "manifest cut", "latest garbage",
                                 "half-written"])
def test_a_damaged_latest_checkpoint_is_reported_and_the_previous_good_one_used(tmp_path, how):
    run(_job, ranks=2, root=str(tmp_path), steps=4, save_at=(2, 4))
    message, good = _damage(tmp_path, how)
    want = run(_job, ranks=2, root=str(tmp_path / "ref"), steps=good)[0]

    def body(comm):
        t = MeshTrainer(comm, small_config())
        info = load(comm, str(tmp_path), t.state())
        return info, t.full_parameters()
    info, got = run(body, ranks=2)[0]
    assert info.step == good and _equal(got, want)
    if message:
        assert any(message in p for p in info.problems), info.problems


def test_no_intact_checkpoint_means_a_fresh_start_or_a_clear_error(tmp_path):
    def body(comm, required):
        state = MeshTrainer(comm, small_config()).state()
        return load(comm, str(tmp_path / "nothing"), state, required=required)
    assert run(body, ranks=1, required=False)[0].step is None
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        run(body, ranks=1, required=True)


@pytest.mark.parametrize("change,message,recorded", [
    ({"dtype": "float32"}, "holds float64, this model has float32", None),
    ({"d_model": 8}, "global shape", None),
    ({"n_layer": 1}, "is for another model", None),
    ({"dtype": "float32"}, "dtype='float64' \\(checkpoint\\) vs 'float32' \\(this model\\)", True),
    ({"n_layer": 1}, "n_layer=2 \\(checkpoint\\) vs 1 \\(this model\\)", True),
    ({"n_head": 2}, "n_head=4 \\(checkpoint\\) vs 2 \\(this model\\)", True),  # the same shapes
])
def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path, change, message, recorded):
    """With the configuration recorded (the MeshTrainer does) it is compared first, naming both sides;
    without it (a TrainState built by hand) the parameters' names, shapes and dtypes still are."""
    run(_job, ranks=1, root=str(tmp_path), steps=1, save_at=(1,))

    def body(comm):
        t = MeshTrainer(comm, small_config().replace(**change))
        state = t.state()
        if not recorded:
            state.config = None
        load(comm, str(tmp_path), state)
    with pytest.raises(CheckpointError, match=message):
        run(body, ranks=1)


def test_disk_full_on_one_rank_fails_the_save_and_keeps_the_previous_latest(tmp_path):
    def body(comm):
        t = MeshTrainer(comm, small_config())
        t.step()
        save(comm, str(tmp_path), 1, t.state())
        t.step()
        save(comm, str(tmp_path), 2, t.state(), fault=Injector.from_env(comm.rank, "diskfull:rank=1,step=2"))
    with pytest.raises(CheckpointError, match="rank 1: disk full at .*step-00000002.tmp/rank-00001.bin: "
                                              "it needs [0-9,]+ bytes"):
        run(body, ranks=2)
    assert _files(tmp_path) == [".minidist-checkpoints", "latest", "step-00000001"]


# -- resharding: any mesh to any mesh ----------------------------------------------------------------

MESHES = [(1, {}), (2, {}), (4, {}), (2, {"tp": 2}), (4, {"tp": 4}), (2, {"pp": 2}), (4, {"pp": 4}),
          (4, {"dp": 2, "tp": 2}), (4, {"pp": 2, "tp": 2}), (8, {"dp": 2, "pp": 2, "tp": 2}),
          (2, {"zero": 1}), (4, {"zero": 2}), (2, {"zero": 3}), (4, {"zero": 3})]


@budget(4)
@given(src=st.sampled_from(MESHES), dst=st.sampled_from(MESHES))
@example(src=(8, {"dp": 2, "pp": 2, "tp": 2}), dst=(4, {"dp": 2, "pp": 2}))  # 8 ranks -> 4, tp 2 -> 1
@example(src=(4, {"pp": 4}), dst=(2, {"pp": 2}))                            # pp 4 -> 2
@example(src=(4, {"zero": 3}), dst=(2, {}))                                 # ZeRO-3 -> plain DDP
@example(src=(4, {"dp": 2, "tp": 2}), dst=(1, {}))                          # any mesh -> one process
def test_reshard_any_mesh_to_any_mesh(tmp_path_factory, src, dst):
    """Saved on one mesh, loaded on another: the full parameters and optimizer state are exactly the
    saved ones, and training on equals the source job trained on (summation orders differ: a
    tolerance)."""
    root = str(tmp_path_factory.mktemp("reshard"))
    (n, kw), (m, kw2) = src, dst
    saved = run(_job, ranks=n, root=root, steps=2, save_at=(2,), dropout=0.0, full_state=True, **kw)[0]
    on_source = run(_job, ranks=n, root=root + "-x", steps=4, dropout=0.0, **kw)[0]
    reloaded = run(_job, ranks=m, root=root, steps=2, resume=True, dropout=0.0, full_state=True, **kw2)[0]
    assert len(saved) == 3 * len(on_source) and _equal(reloaded, saved)  # parameters, m and v
    trained_on = run(_job, ranks=m, root=root, steps=4, resume=True, dropout=0.0, **kw2)[0]
    for k in on_source:
        np.testing.assert_allclose(trained_on[k], on_source[k], rtol=0, atol=1e-10, err_msg=k)


# -- asynchronous, two tiers ---------------------------------------------------------------------------

def _tiered(comm, root, steps, fault="", delete_memory=False):
    t = MeshTrainer(comm, small_config())
    tiers = [Tier("memory", os.path.join(root, "mem"), 1, keep=2),
             Tier("disk", os.path.join(root, "disk"), 3)]
    ck = Checkpointer(comm, tiers, asynchronous=True, fault=Injector.from_env(comm.rank, fault))
    if delete_memory and comm.rank == 0:
        import shutil

        shutil.rmtree(os.path.join(root, "mem"))
    comm.barrier()
    info, tier = ck.restore(t.state())
    while t.step_count < steps:
        t.step()
        ck.maybe_save(t.step_count, t.state())
    ck.wait()
    return t.full_parameters(), info.step, tier, ck.errors


def test_async_two_tier_resume_uses_the_newest_fastest_intact_tier(tmp_path):
    root = str(tmp_path)
    want = run(_tiered, ranks=2, root=root + "/ref", steps=6)[0][0]
    run(_tiered, ranks=2, root=root, steps=4)
    got, step, tier, _ = run(_tiered, ranks=2, root=root, steps=6)[0]
    assert (step, tier) == (4, "memory") and _equal(got, want)
    got, step, tier, _ = run(_tiered, ranks=2, root=root, steps=6, delete_memory=True)[0]
    assert (step, tier) == (6, "disk") and _equal(got, want)


def test_async_write_failure_is_reported_and_training_goes_on(tmp_path):
    got, _, _, errors = run(_tiered, ranks=2, root=str(tmp_path), steps=3, fault="diskfull:rank=1,step=3")[0]
    assert any("disk step 3" in e and "No space left" in e for e in errors), errors
    assert os.listdir(tmp_path / "disk") == [".minidist-checkpoints"]  # nothing half-written was left


@budget(30)
@given(cuts=st.lists(st.integers(1, 47), max_size=5, unique=True), lo=st.integers(0, 47),
       width=st.integers(1, 48), target=st.sampled_from(["flat", "rows", "columns", "qkv"]),
       part=st.integers(0, 1))
@example(cuts=[7], lo=6, width=6, target="flat", part=0)  # a source piece that ends where the target starts
def test_assemble_copies_exactly_the_overlap_of_any_pieces(cuts, lo, width, target, part):
    """Pieces that are flat ranges of a (4, 12) tensor, cut anywhere, give any target piece: expected
    values are sliced out of the full array with plain NumPy."""
    from minidist.parallel.tensor.sharding import Shard
    from minidist.parallel.tensor.slices import global_slices
    from minidist.resilience.checkpoint.layout import Slot, assemble

    full = np.arange(48.0).reshape(4, 12) * 1.5
    bounds = [0, *sorted(cuts), 48]
    store = {i: full.reshape(-1)[a:b] for i, (a, b) in enumerate(zip(bounds, bounds[1:]))}
    pieces = [{"file": "f", "offset": i, "nbytes": 0, "axis": None, "ranges": None, "flat": [a, b]}
              for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    tensor = {"shape": [4, 12], "dtype": "<f8", "pieces": pieces}
    grid = np.arange(48).reshape(4, 12)  # global flat indices, sliced as the target piece is
    if target == "flat":
        hi = min(48, lo + width)
        slot, idx = Slot("x", (4, 12), np.float64, None, None, flat=(lo, hi)), grid.reshape(-1)[lo:hi]
    else:
        shard = {"rows": Shard(0), "columns": Shard(1), "qkv": Shard(1, blocks=3)}[target]
        local = full[:2] if target == "rows" else full[:, :6]  # a part's shape: the slices name the rest
        shape, axis, ranges = global_slices([("x", local)], {"x": shard}, part, 2)["x"]
        assert shape == (4, 12)
        slot = Slot("x", shape, np.float64, None, None, axis=axis, ranges=ranges)
        if target == "rows":
            idx = grid[2 * part:2 * part + 2]
        elif target == "columns":
            idx = grid[:, 6 * part:6 * part + 6]
        else:  # q|k|v blocks of 4 columns, each halved
            idx = np.concatenate([grid[:, 4 * b + 2 * part:4 * b + 2 * part + 2] for b in range(3)], axis=1)
    read = []
    got = assemble(slot, tensor, lambda p: read.append(p["offset"]) or store[p["offset"]])
    np.testing.assert_array_equal(got, full.reshape(-1)[idx])
    overlapping = [i for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if ((idx >= a) & (idx < b)).any()]
    assert sorted(read) == overlapping  # only the pieces it needs, each once


# -- mixed precision: the loss scaler, and a DistributedSampler's shuffles ------------------------------

def _mixed_job(comm, root, steps, save_at=(), resume=False):
    """fp16 with a dynamic loss scaler (which skips and grows), dropout, a reshuffling sampler, 2 ranks."""
    import types

    from minidist.autograd import random as mrandom
    from minidist.nn import GPT
    from minidist.nn.data import DistributedSampler, SyntheticTask
    from minidist.nn.optim import AdamW
    from minidist.parallel.memory.precision import DynamicLossScaler, MixedPrecision
    from minidist.resilience.checkpoint import Attrs, TrainState

    mrandom.manual_seed(5 + comm.rank)
    data = SyntheticTask("sort", length=4, size=32, seed=1)
    mp = MixedPrecision(GPT(small_config("float32", 0.1)), "fp16",
                        scaler=DynamicLossScaler(init_scale=2.0 ** 16, growth_interval=2), groups=[comm])
    opt = AdamW(mp.master_params, lr=1e-2)
    sampler = DistributedSampler(len(data), comm.rank, comm.size, seed=3)
    cursor = types.SimpleNamespace(pos=0, step=0)

    def recast():
        for m, p in zip(mp.master_params, mp.params):
            p.data = m.data.astype(mp.dtype)
    masters = types.SimpleNamespace(named_parameters=lambda: [(m.name, m) for m in mp.master_params])
    state = TrainState(masters, opt, objects={"scaler": mp.scaler, "sampler": Attrs(sampler, "epoch"),
                                              "cursor": Attrs(cursor, "pos", "step")}, on_load=[recast])
    if resume:
        load(comm, root, state, required=True)
    scales = []
    while cursor.step < steps:
        idx = sampler.indices()
        if cursor.pos + 4 > len(idx):
            sampler.set_epoch(sampler.epoch + 1)
            cursor.pos, idx = 0, sampler.indices()
        x, y = data.get(idx[cursor.pos:cursor.pos + 4])
        cursor.pos += 4
        loss = mp.loss(x, y)
        mp.backward(loss)
        mp.all_reduce_grads(comm)
        mp.step(opt)
        cursor.step += 1
        scales.append(mp.scale)
        if cursor.step in save_at:
            save(comm, root, cursor.step, state)
    return {m.name: m.data.copy() for m in mp.master_params}, scales, sampler.epoch


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # fp16 overflows on purpose: the scaler skips
def test_mixed_precision_resume_restores_the_loss_scaler_and_the_sampler(tmp_path):
    full, scales, epoch = run(_mixed_job, ranks=2, root=str(tmp_path), steps=7, save_at=(5,))[0]
    pairs = list(zip(scales, scales[1:]))
    assert epoch == 1 and any(b > a for a, b in pairs) and any(b < a for a, b in pairs)  # grew, and skipped
    got, scales2, _ = run(_mixed_job, ranks=2, root=str(tmp_path), steps=7, resume=True)[0]
    assert _equal(got, full) and scales2 == scales[5:]


def _megatron_rng_job(comm, root, steps, save_at=(), resume=False, keep_rng=True):
    """Tensor parallel with sequence parallelism and Megatron's per-rank dropout generator."""
    from minidist.autograd import random as mrandom
    from minidist.nn.optim import AdamW
    from minidist.parallel.tensor.gpt import TPGPT
    from minidist.parallel.tensor.sharding import serial_state_dict, sharding_table
    from minidist.parallel.tensor.slices import global_slices
    from minidist.resilience.checkpoint import TrainState

    mrandom.manual_seed(11)
    model = TPGPT(small_config("float64", 0.2), comm, sequence_parallel=True, dropout_rng="megatron")
    opt = AdamW(model.parameters(), lr=1e-2)
    x, y = np.random.default_rng(0).integers(0, 12, (2, 4, 8))
    rngs = {"tp dropout": model.sharded_rng.generator} if keep_rng else {}
    slices = global_slices(model.named_parameters(), sharding_table(model), comm.rank, comm.size)
    state = TrainState(model, opt, slices=slices, rngs=rngs)
    if resume:
        load(comm, root, state, required=True)
    while opt.step_count < steps:
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
        if opt.step_count in save_at:
            save(comm, root, opt.step_count, state)
    return serial_state_dict(model)


@pytest.mark.parametrize("keep_rng", [True, False])
def test_tensor_parallel_sharded_rng_stream_is_restored(tmp_path, keep_rng):
    full = run(_megatron_rng_job, ranks=2, root=str(tmp_path), steps=4, save_at=(2,), keep_rng=keep_rng)[0]
    got = run(_megatron_rng_job, ranks=2, root=str(tmp_path), steps=4, resume=True, keep_rng=keep_rng)[0]
    assert _equal(got, full) == keep_rng  # without the per-rank generator the dropout masks differ


def _lose_host(root, host):
    """Delete everything ``host`` wrote (its RAM is gone): the files whose manifest says it wrote them,
    and the manifests it committed."""
    for d in [d for d in sorted(os.listdir(root)) if d.startswith("step-")]:
        m = json.loads(open(os.path.join(root, d, "manifest.json")).read())
        for name, meta in m["files"].items():
            if meta["writer"] == host:
                os.remove(os.path.join(root, d, name))
        if m["committed_by"] == host:
            os.remove(os.path.join(root, d, "manifest.json"))


def _peer_job(comm, root, steps, lose=None):
    t = MeshTrainer(comm, small_config(), zero=1, batch_size=6)  # every rank holds a different shard
    tiers = [Tier("memory", f"{root}/mem", 2), Tier("peer", f"{root}/peer", 2, peer=True),
             Tier("disk", f"{root}/disk", 4)]
    ck = Checkpointer(comm, tiers)
    if lose is not None and comm.rank == 0:
        for tier in tiers[:2]:
            _lose_host(tier.root, lose)
    comm.barrier()
    info, tier = ck.restore(t.state())
    while t.step_count < steps:
        t.step()
        ck.maybe_save(t.step_count, t.state())
    ck.wait()
    return t.full_parameters(), info.step, tier


@pytest.mark.parametrize("lose", [0, 1])  # the committer of the memory tier, and of the peer tier
def test_peer_tier_recovers_a_lost_hosts_shards_from_its_neighbour(tmp_path, lose):
    want = run(_peer_job, ranks=3, root=str(tmp_path / "ref"), steps=8)[0][0]
    run(_peer_job, ranks=3, root=str(tmp_path), steps=6)
    got, step, tier = run(_peer_job, ranks=3, root=str(tmp_path), steps=8, lose=lose)[0]
    assert (step, tier) == (6, "memory+peer") and _equal(got, want)  # not disk's step 4


def _save_and_choose(comm, roots, order, damage=None):
    """Save one step into every root, optionally damage a file in one root, then ``files.choose``
    over the roots in ``order``: the directory each file is read from, per file."""
    from minidist.resilience.checkpoint import files

    t = MeshTrainer(comm, small_config("float64", 0.0), zero=1)  # ZeRO: every rank writes a file
    t.step()
    for r in roots:
        save(comm, r, t.step_count, t.state(), keep=3)
    comm.barrier()
    name = None
    if damage is not None:
        root, pick = damage
        step_dir = os.path.join(root, f"step-{t.step_count:08d}")
        names = sorted(files.read_manifest(step_dir)["files"])
        name = [n for n in names if os.path.getsize(os.path.join(step_dir, n))][pick]
    if name is not None and comm.rank == 0:
        with open(os.path.join(step_dir, name), "r+b") as fh:
            fh.seek(0)
            b = fh.read(1)
            fh.seek(0)
            fh.write(bytes([b[0] ^ 0xFF]))
    comm.barrier()
    where, manifest, _ = files.choose(comm, [roots[i] for i in order])
    return {n: os.path.dirname(os.path.normpath(d)) for n, d in where.items()}, name


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_a_file_intact_in_several_roots_is_read_from_the_first_and_a_damaged_one_from_the_next(tmp_path,
                                                                                             order):
    """Tiers are listed fastest first: every file comes from the first root that holds it intact;
    a file damaged there comes from the next root in the list, the others still from the first."""
    roots = [str(tmp_path / f"root{i}") for i in range(3)]
    first, second = roots[order[0]], roots[order[1]]
    where, _ = run(_save_and_choose, ranks=2, roots=roots, order=order)[0]
    assert set(where.values()) == {first}
    damaged, name = run(_save_and_choose, ranks=2, roots=roots, order=order, damage=(first, 1))[0]
    assert damaged[name] == second, damaged
    assert all(d == first for n, d in damaged.items() if n != name)


def _gqa_job(comm, root, steps, n_kv_head, save_at=(), resume=False, **kw):
    """``_job`` on a grouped-query GPT (n_head 4, ``n_kv_head`` K/V heads): its q|k|v weight is blocks
    of unequal widths, split or (tp not dividing n_kv_head) replicated over tp."""
    t = MeshTrainer(comm, small_config("float64", 0.0).replace(n_kv_head=n_kv_head), **kw)
    if resume:
        load(comm, root, t.state(), required=True)
    while t.step_count < steps:
        t.step()
        if t.step_count in save_at:
            save(comm, root, t.step_count, t.state(), keep=3)
    return t.full_parameters()


@pytest.mark.parametrize("n_kv_head", [2, 1])  # tp = 2 splits 2 K/V heads, replicates 1
def test_a_grouped_query_tp_checkpoint_reshards_to_one_process_and_back(tmp_path, n_kv_head):
    """Saved by tp = 2, loaded by one process and by tp = 2 again: the full parameters are the saved ones
    (the manifest keeps q|k|v's block widths, and which blocks every rank holds whole)."""
    root = str(tmp_path)
    saved = run(_gqa_job, ranks=2, root=root, steps=2, n_kv_head=n_kv_head, save_at=(2,), tp=2)[0]
    alone = run(_gqa_job, ranks=1, root=root, steps=2, n_kv_head=n_kv_head, resume=True)[0]
    again = run(_gqa_job, ranks=2, root=root, steps=2, n_kv_head=n_kv_head, resume=True, tp=2)[0]
    assert _equal(alone, saved) and _equal(again, saved)


def test_a_checkpointers_fault_hits_the_disk_tier_only_and_the_memory_tier_still_saves(tmp_path):
    """The Checkpointer's fault acts on the last tier (the disk): a read-only disk at step 3 fails the
    disk save of step 3 alone, reported as such, while the memory tier saves step 3 as usual."""
    from minidist.resilience.checkpoint.files import list_steps

    _, _, _, errors = run(_tiered, ranks=2, root=str(tmp_path), steps=3, fault="readonly:rank=0,step=3")[0]
    assert errors and all(e.startswith("disk step 3") for e in errors), errors
    assert list_steps(str(tmp_path / "mem")) == [2, 3]
    assert list_steps(str(tmp_path / "disk")) == []
