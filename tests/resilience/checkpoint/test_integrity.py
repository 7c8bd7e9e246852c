"""A damaged checkpoint is never loaded wrong: hypothesis flips, cuts, deletes and edits the bytes and
fields of the newest checkpoint (its manifest, its rank files, ``latest``, its saved RNG state), and
every outcome must be one of three: loaded bit-identical, fallen back to the previous good
checkpoint with a warning, or a CheckpointError naming the file -- never a silent wrong load, never
another exception. Edited manifests are tried as they are and re-sealed (their digest recomputed,
as a buggy writer would): the rank files' own trailers must catch those."""

import hashlib
import json
import os
import shutil
import warnings

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.comm import run
from minidist.lessons.fault_tolerance_job import MeshTrainer, small_config
from minidist.resilience.checkpoint import CheckpointError, load, save
from minidist.resilience.checkpoint.files import CheckpointWarning
from minidist.resilience.checkpoint.integrity import (
    FOOTER,
    read_trailer,
    seal,
    trailer_bytes,
    unseal,
    validate,
)
from tests.conftest import budget

CFG = small_config("float64", 0.1, n_layer=1)
NEWEST = "step-00000002"
FILES = [f"{NEWEST}/manifest.json", f"{NEWEST}/rank-00000.bin", f"{NEWEST}/rank-00001.bin", "latest"]


def _observed(t):
    """What a resumed job is made of, per rank: full parameters and optimizer state (rank 0), and
    this rank's small state (optimizer scalars, loader, schedule, step, RNG streams) as JSON."""
    return t.full_state(), json.dumps(t.state().small_state(), sort_keys=True)


def _save_two(comm, root):
    t = MeshTrainer(comm, CFG, zero=1, batch_size=4)  # ZeRO: both ranks write pieces
    seen = {}
    for step in (1, 2):
        t.step()
        save(comm, root, step, t.state())
        seen[step] = _observed(t)
    return seen


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    seen = run(_save_two, ranks=2, root=str(root))
    pristine = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            pristine[os.path.relpath(p, root)] = open(p, "rb").read()
    return pristine, seen, tmp_path_factory.mktemp("fuzz")


def _digest(body: dict) -> str:
    """The manifest's digest as documented: sha256 of its canonical JSON without the digest field."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _edit(m: dict, what: str, k: int) -> None:
    """Edit one field of a parsed manifest, the ways the adversarial user did."""
    names = sorted(m["tensors"])
    if what == "offset":
        pieces = [p for t in m["tensors"].values() for p in t["pieces"] if p["nbytes"]]
        pieces[k % len(pieces)]["offset"] += 8
    elif what == "swap":  # model/<x> <-> optim/m/<x>: the same shape, another tensor
        model = [n for n in names if n.startswith("model/") and f"optim/m/{n[6:]}" in m["tensors"]]
        a = model[k % len(model)]
        b = f"optim/m/{a[6:]}"
        m["tensors"][a], m["tensors"][b] = m["tensors"][b], m["tensors"][a]
    elif what == "step":
        m["step"] += 1 + k % 3
    elif what == "loader":
        st_ = m["ranks"][k % 2]["objects"]["loader"]
        key = sorted(st_)[k % len(st_)]
        st_[key] = st_[key] + 1 if isinstance(st_[key], int) else 7
    elif what == "rng":  # one digit of the saved dropout RNG state (may overflow PCG64's 128 bits)
        s = m["ranks"][k % 2]["rngs"]["minidist.autograd.random"]["state"]
        digits = list(str(s["state"]))
        digits[k % len(digits)] = "9" if digits[k % len(digits)] != "9" else "1"
        s["state"] = int("".join(digits)) * (10 ** 30 if k % 2 else 1)
    elif what == "config":
        m["config"]["n_head"] = 2
    elif what == "world":
        m["mesh"]["world"] = 1 + k % 3
    elif what == "drop":  # a top-level field deleted (files, tensors, ranks, mesh, ...)
        del m[sorted(m)[k % len(m)]]
    elif what == "short ranks":
        m["ranks"] = m["ranks"][:1]
    elif what == "no files":
        m["files"] = {}
    elif what == "type":  # a field of the wrong type
        m[["step", "files", "tensors", "ranks", "mesh"][k % 5]] = [None]


EDITS = ["offset", "swap", "step", "loader", "rng", "config", "world", "drop", "short ranks", "no files",
         "type"]


def _damage(root, target, how, at, k, reseal):
    path = os.path.join(root, target)
    blob = open(path, "rb").read()
    pos = int(at * max(len(blob) - 1, 0))
    if how == "flip":
        b = bytearray(blob)
        b[pos] ^= 1 << (k % 8)
        blob = bytes(b)
    elif how == "truncate":
        blob = blob[:pos]
    elif how == "bytes":
        blob = blob[:pos] + bytes((k * 37 + i) % 256 for i in range(1 + k % 9)) + blob[pos + 1 + k % 9:]
    elif how == "delete":
        os.remove(path)
        return
    elif how == "folder":  # e.g. `latest` replaced by a directory
        os.remove(path)
        os.makedirs(path)
        return
    else:  # a field edit of the manifest
        m = json.loads(blob)
        _edit(m, how, k)
        if reseal:
            m["digest"] = _digest({key: v for key, v in m.items() if key != "digest"})
        blob = json.dumps(m, indent=1).encode()
    with open(path, "wb") as f:
        f.write(blob)


def _load(comm, root):
    t = MeshTrainer(comm, CFG, zero=1, batch_size=4)
    info = load(comm, root, t.state())
    return info.step, info.problems, _observed(t)


def _same(got, want):
    (full, small), (wfull, wsmall) = got, want
    if small != wsmall:
        return False
    if full is None or wfull is None:
        return full is None and wfull is None
    return full.keys() == wfull.keys() and all(np.array_equal(full[k], wfull[k]) for k in full)


@budget(30)
@given(target=st.sampled_from(FILES),
       how=st.sampled_from(["flip", "truncate", "bytes", "delete", "folder", *EDITS]),
       at=st.floats(0, 1), k=st.integers(0, 1000), reseal=st.booleans())
@example(target=FILES[0], how="offset", at=0, k=0, reseal=True)
@example(target=FILES[0], how="swap", at=0, k=0, reseal=True)
@example(target=FILES[0], how="step", at=0, k=0, reseal=True)
@example(target=FILES[0], how="loader", at=0, k=1, reseal=True)
@example(target=FILES[0], how="rng", at=0, k=3, reseal=True)
@example(target=FILES[0], how="rng", at=0, k=3, reseal=False)
@example(target=FILES[0], how="config", at=0, k=0, reseal=True)
@example(target=FILES[0], how="drop", at=0, k=1, reseal=True)      # "files" removed
@example(target=FILES[0], how="short ranks", at=0, k=0, reseal=True)
@example(target=FILES[0], how="flip", at=0.5, k=2, reseal=False)
@example(target=FILES[1], how="flip", at=0.999, k=0, reseal=False)  # in the rank file's trailer
@example(target=FILES[2], how="truncate", at=0.5, k=0, reseal=False)
@example(target=FILES[3], how="folder", at=0, k=0, reseal=False)
def test_every_damage_loads_identically_falls_back_with_a_warning_or_is_a_checkpoint_error(
        base, target, how, at, k, reseal):
    pristine, seen, scratch = base
    if how in EDITS and not target.endswith("manifest.json"):
        how = "flip"
    root = os.path.join(scratch, "ckpt")
    shutil.rmtree(root, ignore_errors=True)
    for rel, blob in pristine.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(blob)
    _damage(root, target, how, at, k, reseal)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = run(_load, ranks=2, root=root)
        except CheckpointError as e:
            assert root in str(e), f"the error names no file: {e}"
            return
    step, problems, _ = out[0]
    assert step in (1, 2), f"{how} of {target}: loaded step {step}, problems {problems}"
    for rank, (s, _, got) in enumerate(out):
        assert s == step and _same(got, seen[rank][step]), f"{how} of {target}: rank {rank} loaded wrong"
    if step == 1:  # a fallback: said, with what was wrong and where
        assert problems and all(root in p for p in problems), problems
        assert any(issubclass(w.category, CheckpointWarning) for w in caught), "fell back silently"


def _fresh_copy(base, name):
    pristine, seen, scratch = base
    root = os.path.join(scratch, name)
    shutil.rmtree(root, ignore_errors=True)
    for rel, blob in pristine.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(blob)
    return root, seen


def test_the_manifest_digest_is_the_sha256_of_its_canonical_json(base):
    root, _ = _fresh_copy(base, "digest")
    m = json.loads(open(os.path.join(root, NEWEST, "manifest.json")).read())
    assert m["digest"] == _digest({k: v for k, v in m.items() if k != "digest"})
    assert m["config"]["n_head"] == CFG.n_head and m["mesh"] == {"dp": 2, "pp": 1, "tp": 1, "zero": 1,
                                                                   "world": 2}


@pytest.mark.parametrize("how", ["offset", "swap", "step", "loader", "rng", "config"])
@pytest.mark.parametrize("reseal", [False, True])
def test_each_edit_is_caught_by_the_digest_or_if_resealed_by_the_rank_files_trailers(base, how, reseal):
    """Unsealed: the digest differs. Re-sealed: the rank files' trailers (inside their sha256)
    disagree with the manifest -- or, for the step, the step directory's name does."""
    root, seen = _fresh_copy(base, f"edit-{how}-{reseal}")
    _damage(root, f"{NEWEST}/manifest.json", how, 0, 1, reseal)
    out = run(_load, ranks=2, root=root)
    step, problems, _ = out[0]
    assert step == 1 and all(_same(got, seen[r][1]) for r, (_, _, got) in enumerate(out))
    want = ("folder of step 2" if how == "step" else "trailer and the manifest disagree") if reseal else \
        "digest"
    assert any(want in p for p in problems), problems


# -- the corruption tables by hand: boundary and missing-field rows of ``validate``, ``unseal`` and
# ``read_trailer`` on a manifest and files written out here (a 4x2 float32 tensor ``w``, one rank) --

def _manifest(**piece) -> dict:
    p = {"file": "rank-00000.bin", "dtype": "<f4", "shape": [4, 2], "offset": 0, "nbytes": 32, "axis": None,
         "ranges": None, "flat": None, **piece}
    return {"step": 3, "mesh": {"world": 1}, "ranks": [{}],
            "files": {"rank-00000.bin": {"sha256": "0" * 64, "bytes": 32}},
            "tensors": {"w": {"shape": [4, 2], "dtype": "<f4", "pieces": [p]}}}


def _drop(m, *keys):
    d = m
    for k in keys[:-1]:
        d = d[k]
    del d[keys[-1]]
    return m


VALIDATE = [  # (the manifest, None if valid else what the error says)
    (_manifest(), None),
    (_manifest(axis=0, ranges=[[0, 4]]), None),
    (_manifest(axis=0, ranges=[[2, 4]], shape=[2, 2], nbytes=16), None),             # ends at the axis' end
    (_manifest(axis=0, ranges=[[3, 5]], shape=[2, 2], nbytes=16), "outside axis 0 of length 4"),  # 1 past
    (_manifest(axis=0, ranges=[[4, 4]], shape=[0, 2], nbytes=0), "outside axis 0"),   # an empty range
    (_manifest(axis=1, ranges=[[1, 3]], shape=[4, 2], nbytes=32), "outside axis 1 of length 2"),
    (_manifest(axis=2, ranges=[[0, 1]], shape=[4, 2], nbytes=32), "piece axis 2"),     # axis == ndim
    (_manifest(axis=0, ranges=None), "without ranges"),
    (_manifest(flat=[0, 8], shape=[8]), None),                                       # the whole of it
    (_manifest(flat=[1, 9], shape=[8]), "flat range [1, 9] of 8 elements"),          # 1 past
    (_manifest(flat=[5, 4], shape=[0], nbytes=0), "flat range [5, 4]"),
    (_manifest(shape=[4, 1], nbytes=16), "of shape [4, 1] where its layout holds 8"),
    (_manifest(nbytes=28), "piece of 28 bytes for shape [4, 2]"),
    (_manifest(offset=1), "piece past the end of rank-00000.bin"),                   # ends 1 past the file
    (_manifest(dtype="<f8", nbytes=64), "piece dtype"),
    (_manifest(file="rank-00001.bin"), "piece in no file"),
    (_manifest(offset=-8), "piece dtype, shape, offset or size"),
    (_drop(_manifest(), "files", "rank-00000.bin", "sha256"), "rank-00000.bin: no sha256 or size"),
    (_drop(_manifest(), "files", "rank-00000.bin", "bytes"), "rank-00000.bin: no sha256 or size"),
    (_drop(_manifest(), "mesh", "world"), "1 ranks' state for a world of None"),
    (dict(_manifest(), ranks=[{}, {}]), "2 ranks' state for a world of 1"),
    (dict(_manifest(), files={}), "not one per rank of 1"),
    (_drop(_manifest(), "tensors", "w", "pieces"), "tensor 'w': shape or pieces"),
    (_drop(_manifest(), "tensors", "w", "pieces", 0, "axis"), "malformed manifest (KeyError: 'axis')"),
    (_drop(_manifest(), "step"), "'step' is missing"),
]


@pytest.mark.parametrize("m,said", VALIDATE)
def test_validate_table_by_hand(m, said):
    if said is None:
        assert validate(m, "M", 3) is m
    else:
        with pytest.raises(CheckpointError) as e:
            validate(m, "M", 3)
        assert str(e.value).startswith("M: malformed manifest") and said in str(e.value), str(e.value)


def test_a_manifest_in_the_folder_of_another_step_is_refused():
    with pytest.raises(CheckpointError, match="step 3 in the folder of step 4"):
        validate(_manifest(), "M", 4)


@pytest.mark.parametrize("digest", ["deleted", None, "", "0" * 64, "upper"])
def test_a_manifest_whose_digest_is_deleted_empty_or_wrong_is_refused(digest):
    m = seal(_manifest())
    assert _digest({k: v for k, v in m.items() if k != "digest"}) == m["digest"] and unseal(m, "M") is m
    if digest == "deleted":
        del m["digest"]
    else:
        m["digest"] = m["digest"].upper() if digest == "upper" else digest
    with pytest.raises(CheckpointError, match="^M: digest .* differs from the sha256 of its content"):
        unseal(m, "M")


def _trailer_file(path, body: bytes, length: int | None = None, footer: bytes = FOOTER) -> str:
    n = len(body) if length is None else length
    path.write_bytes(b"\1" * 8 + body + n.to_bytes(8, "little") + footer)
    return str(path)


def test_read_trailer_reads_the_trailer_and_a_trailer_that_is_the_whole_file(tmp_path):
    info = {"pieces": [{"name": "w"}], "step": 3}
    p = tmp_path / "f"
    p.write_bytes(b"\1" * 8 + trailer_bytes(info))
    assert read_trailer(p) == info
    p.write_bytes(trailer_bytes(info))  # length = size - 16: the trailer starts at byte 0
    assert read_trailer(p) == info


TRAILERS = [  # (body, length written (None: its own), footer, what the error says)
    (b'{"pieces":[]}', 8 + 13 + 1, FOOTER, "no checkpoint trailer at its end"),   # 1 byte past the start
    (b'{"pieces":[]}', 2 ** 64 - 1, FOOTER, "no checkpoint trailer at its end"),
    (b'{"pieces":[]}', None, b"mdckpt01", "no checkpoint trailer at its end"),      # another format
    (b'{"pieces":[]', None, FOOTER, "its trailer is not valid JSON"),
    (b'\xff{"pieces":[]}', None, FOOTER, "its trailer is not valid JSON"),
    (b'{"step":3}', None, FOOTER, "its trailer has no list of pieces"),              # pieces missing
    (b'{"pieces":{}}', None, FOOTER, "its trailer has no list of pieces"),
    (b'[]', None, FOOTER, "its trailer has no list of pieces"),
    (b'{"pieces":[]}', 12, FOOTER, "its trailer is not valid JSON"),                 # one byte short
]


@pytest.mark.parametrize("body,length,footer,said", TRAILERS)
def test_read_trailer_refuses_each_damage_naming_the_file(tmp_path, body, length, footer, said):
    path = _trailer_file(tmp_path / "rank-00000.bin", body, length, footer)
    with pytest.raises(CheckpointError, match=f"^{path}: {said}"):
        read_trailer(path)


@pytest.mark.parametrize("size", [0, 1, 8, 15])
def test_a_file_shorter_than_a_trailers_end_is_truncated(tmp_path, size):
    p = tmp_path / "rank-00000.bin"
    p.write_bytes((b"\0" * 8 + FOOTER)[:size])
    with pytest.raises(CheckpointError, match=f"{size} bytes, too short for its trailer"):
        read_trailer(p)


@given(lo=st.integers(0, 6), hi=st.integers(0, 6), a=st.integers(0, 10), b=st.integers(0, 10),
       offset=st.integers(0, 40))
def test_validate_accepts_a_piece_exactly_when_it_lies_inside_its_axis_rows_and_file(lo, hi, a, b, offset):
    """Rows lo..hi of the 4x2 tensor, then elements a..b of those, at ``offset`` of a 40-byte file: valid
    iff lo < hi <= 4, a <= b <= 2 (hi - lo) and offset + 4 (b - a) <= 40 -- the rule written out."""
    n = 2 * max(hi - lo, 0)
    m = _manifest(axis=0, ranges=[[lo, hi]], flat=[a, b], shape=[max(b - a, 0)], nbytes=4 * max(b - a, 0),
                  offset=offset)
    m["files"]["rank-00000.bin"]["bytes"] = 40
    valid = lo < hi <= 4 and a <= b <= n and offset + 4 * (b - a) <= 40
    try:
        validate(m, "M")
        assert valid
    except CheckpointError:
        assert not valid
