"""Every byte of a checkpoint is covered: the manifest's digest, each file's trailer, the checks between.

* The **manifest** carries ``digest``: the sha256 of its own canonical JSON (sorted keys, no spaces)
  without that field (``seal``/``unseal``). A flipped byte, an edited offset, two names swapped, a
  step count or an RNG state changed: the digest differs, and the checkpoint is skipped.
* Each **rank file** ends with a *trailer* that describes the file from the inside -- every piece's
  name, global shape and dtype, offset, size, layout, and the step, job, model configuration, mesh
  and the rank's small state (loader position, RNG streams)::

      [piece bytes ...][trailer: canonical JSON][trailer length: 8 bytes LE][b"mdckpt02"]

  The file's sha256 (in the manifest) covers the trailer, so the manifest and the files vouch for
  each other: ``cross_check`` holds the manifest's account of a file against the file's own. A
  manifest re-sealed after an edit (a buggy writer) is still caught there.
* ``validate`` checks the manifest's structure (types, ranges, pieces inside their files) so that a
  damaged checkpoint is always a ``CheckpointError`` naming the file -- never a KeyError later.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np

from minidist.resilience.checkpoint.errors import CheckpointError

FOOTER = b"mdckpt02"
_FILE = re.compile(r"^rank-\d{5}\.bin$")
_SMALL_KEYS = ("step", "job", "config", "mesh")  # what each trailer repeats of the manifest


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def seal(manifest: dict) -> dict:
    """The manifest with its ``digest``."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return dict(body, digest=hashlib.sha256(canonical(body)).hexdigest())


def unseal(manifest: dict, path) -> dict:
    """Check the digest (CheckpointError naming ``path`` if it is missing or differs)."""
    want = manifest.get("digest")
    body = {k: v for k, v in manifest.items() if k != "digest"}
    try:
        got = hashlib.sha256(canonical(body)).hexdigest()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: not canonical JSON ({e}): corrupted") from None
    if want != got:
        raise CheckpointError(f"{path}: digest {str(want)[:16]!r}... differs from the sha256 of its "
                              "content: the manifest was edited or corrupted")
    return manifest


def trailer_bytes(info: dict) -> bytes:
    t = canonical(info)
    return t + len(t).to_bytes(8, "little") + FOOTER


def read_trailer(path) -> dict:
    """A rank file's own account of itself (CheckpointError if it has none or it does not parse)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < 16:
            raise CheckpointError(f"{path}: {size} bytes, too short for its trailer (truncated)")
        f.seek(size - 16)
        end = f.read(16)
        n = int.from_bytes(end[:8], "little")
        if end[8:] != FOOTER or n > size - 16:
            raise CheckpointError(f"{path}: no checkpoint trailer at its end (truncated or overwritten)")
        f.seek(size - 16 - n)
        raw = f.read(n)
    try:
        t = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: its trailer is not valid JSON ({e})") from None
    if not isinstance(t, dict) or not isinstance(t.get("pieces"), list):
        raise CheckpointError(f"{path}: its trailer has no list of pieces")
    return t


def file_account(manifest: dict, name: str) -> dict:
    """What the manifest says file ``name`` holds, in the trailer's form (to compare the two)."""
    pieces = []
    for tname, t in manifest["tensors"].items():
        for p in t["pieces"]:
            if p["file"] == name:
                pieces.append({"name": tname, "global_shape": t["shape"], "global_dtype": t["dtype"],
                               **{k: v for k, v in p.items() if k != "file"}})
    pieces.sort(key=lambda p: (p["offset"], p["name"]))
    rank = int(name[5:10])
    return {"rank": rank, "small": manifest["ranks"][rank], "pieces": pieces,
            **{k: manifest.get(k) for k in _SMALL_KEYS}}


def cross_check(path, manifest: dict, name: str) -> str | None:
    """None if file ``name``'s trailer says what the manifest says about it, else the difference."""
    try:
        own = read_trailer(path)
    except CheckpointError as e:
        return str(e)
    own = dict(own, pieces=sorted(own["pieces"], key=lambda p: (p.get("offset", -1), str(p.get("name")))))
    mine = file_account(manifest, name)
    if canonical(own) == canonical(mine):
        return None
    diff = sorted(k for k in set(own) | set(mine) if canonical(own.get(k)) != canonical(mine.get(k)))
    return f"{path}: its trailer and the manifest disagree about {', '.join(diff)} (edited manifest?)"


def _need(ok: bool, path, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{path}: malformed manifest: {what}")


def _ints(x) -> bool:
    return isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x)


def validate(m: dict, path, step: int | None = None) -> dict:
    """Check the structure of a (digest-checked) manifest; ``step``: the one its directory names."""
    try:
        _validate(m, path, step)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
        raise CheckpointError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None
    return m


def _validate(m: dict, path, step) -> None:
    for key, kind in (("step", int), ("files", dict), ("tensors", dict), ("ranks", list), ("mesh", dict)):
        _need(isinstance(m.get(key), kind), path, f"{key!r} is missing or not a {kind.__name__}")
    _need(step is None or m["step"] == step, path, f"step {m['step']} in the folder of step {step}")
    world = m["mesh"].get("world")
    _need(isinstance(world, int) and world >= 1 and len(m["ranks"]) == world, path,
          f"{len(m['ranks'])} ranks' state for a world of {world}")
    _need(all(isinstance(r, dict) for r in m["ranks"]), path, "a rank's state is not an object")
    _need(set(m["files"]) == {f"rank-{r:05d}.bin" for r in range(world)}, path,
          f"files {sorted(m['files'])[:4]} are not one per rank of {world}")
    for name, meta in m["files"].items():
        _need(_FILE.match(name) is not None and isinstance(meta, dict), path, f"file entry {name!r}")
        _need(isinstance(meta.get("sha256"), str) and _ints([meta.get("bytes")]), path,
              f"{name}: no sha256 or size")
    for tname, t in m["tensors"].items():
        _need(isinstance(t, dict) and _ints(t.get("shape")) and isinstance(t.get("pieces"), list),
              path, f"tensor {tname!r}: shape or pieces")
        dtype = np.dtype(t["dtype"])
        for p in t["pieces"]:
            _need(isinstance(p, dict) and p.get("file") in m["files"], path, f"{tname}: piece in no file")
            _need(np.dtype(p["dtype"]) == dtype and _ints(p["shape"]) and _ints([p["offset"], p["nbytes"]]),
                  path, f"{tname}: piece dtype, shape, offset or size")
            _need(p["nbytes"] == int(np.prod(p["shape"], dtype=np.int64)) * dtype.itemsize, path,
                  f"{tname}: piece of {p['nbytes']} bytes for shape {p['shape']}")
            _need(p["offset"] + p["nbytes"] <= m["files"][p["file"]]["bytes"], path,
                  f"{tname}: piece past the end of {p['file']}")
            _check_layout(p, t["shape"], path, tname)


def _check_layout(p: dict, shape: list, path, tname: str) -> None:
    """A piece's place in its tensor: ranges inside ``shape`` along a real axis, a flat range inside
    them, and as many elements as its bytes hold."""
    axis, ranges, flat = p["axis"], p["ranges"], p["flat"]
    n = int(np.prod(shape, dtype=np.int64))
    if ranges is not None:
        _need(_ints([axis]) and axis < len(shape) and isinstance(ranges, list) and ranges, path,
              f"{tname}: piece axis {axis!r}, ranges {ranges!r}")
        _need(all(_ints(r) and len(r) == 2 and r[0] < r[1] <= shape[axis] for r in ranges), path,
              f"{tname}: piece ranges {ranges} outside axis {axis} of length {shape[axis]}")
        n = n // shape[axis] * sum(hi - lo for lo, hi in ranges)
    else:
        _need(axis is None, path, f"{tname}: piece axis {axis!r} without ranges")
    if flat is not None:
        _need(_ints(flat) and len(flat) == 2 and flat[0] <= flat[1] <= n, path,
              f"{tname}: piece flat range {flat} of {n} elements")
        n = flat[1] - flat[0]
    _need(int(np.prod(p["shape"], dtype=np.int64)) == n, path,
          f"{tname}: a piece of shape {p['shape']} where its layout holds {n} elements")
