"""A memory accountant: per-rank bytes of parameters, gradients, optimizer state and activations.

Two kinds of numbers:

* **State** (``report(model, optimizer)``): bytes of the arrays that live between steps --
  parameters, gradients, optimizer state. Arrays that share storage (views of one flat buffer,
  as DDP and ZeRO make) are counted once, by their underlying buffer: :func:`storage_bytes`.
  An optimizer (or wrapper such as ``ZeRO``) that keeps its own shards says what it holds with a
  ``memory_arrays()`` method returning ``{"params": [...], "grads": [...], "optimizer_state": [...]}``;
  otherwise the accountant reads ``model.parameters()`` (``.data``, ``.grad``) and ``optimizer.state``.
* **Activations** (``with acct.track_activations(): loss = model.loss(x, y)``): every array an op
  saves for backward passes through ``saved_tensors_hooks``; the accountant adds its bytes when it
  is saved and subtracts them when backward releases it, and keeps the peak. Parameters that ops
  save (``linear`` keeps its weight) are not activations: pass ``model`` to leave them out.

Formulas to compare with (Ψ parameters, N data-parallel ranks, bytes per element P params, G grads,
K optimizer state; AdamW in fp32: P=G=4, K=8):  DP (P+G+K)Ψ;  ZeRO-1 (P+G)Ψ + KΨ/N;
ZeRO-2 PΨ + (G+K)Ψ/N;  ZeRO-3 (P+G+K)Ψ/N.  See :func:`zero_formula`.
"""

from __future__ import annotations

import contextlib
import numbers
import threading

from minidist.autograd.tensor import current_saved_tensors_hooks, saved_tensors_hooks


def _root(a):
    """The array that owns ``a``'s memory (NumPy/CuPy follow ``.base``; others are their own)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def storage_bytes(arrays) -> int:
    """Bytes of the distinct buffers behind ``arrays`` (None entries skipped; views counted once)."""
    seen, total = set(), 0
    for a in arrays:
        if a is None:
            continue
        r = _root(a)
        if id(r) not in seen:
            seen.add(id(r))
            total += int(r.nbytes)
    return total


def _state_arrays(optimizer) -> list:
    out = []
    for st in getattr(optimizer, "state", []) or []:
        out.extend(v for v in st.values() if hasattr(v, "nbytes"))
    return out


def state_arrays(model, optimizer=None) -> dict:
    """``{"params", "grads", "optimizer_state"}`` -> lists of arrays this rank holds."""
    for holder in (optimizer, model):
        if holder is not None and hasattr(holder, "memory_arrays"):
            return holder.memory_arrays()
    params = model.parameters()
    return {"params": [p.data for p in params], "grads": [p.grad for p in params],
            "optimizer_state": _state_arrays(optimizer) if optimizer is not None else []}


class _Saved:
    """What the pack hook stores in place of a saved array: the array plus a release callback."""

    __slots__ = ("array", "_release")

    def __init__(self, array, release):
        self.array, self._release = array, release

    def __del__(self):  # the graph dropped it (backward ran, or the graph was discarded)
        if self._release is not None:
            self._release()


class MemoryAccountant:
    """Counts one rank's bytes. Thread-safe; one per rank (the threads transport shares a process)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live: dict[int, list] = {}  # buffer id -> [references, nbytes, buffer]
        self.activation_bytes = 0
        self.peak_activation_bytes = 0

    # -- activations saved for backward --------------------------------------------------------
    def _add(self, root) -> int:
        key = id(root)
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [0, int(root.nbytes), root]
                self.activation_bytes += entry[1]
                self.peak_activation_bytes = max(self.peak_activation_bytes, self.activation_bytes)
            entry[0] += 1
        return key

    def _drop(self, key) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._live[key]
                self.activation_bytes -= entry[1]

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_activation_bytes = self.activation_bytes

    @contextlib.contextmanager
    def track_activations(self, model=None, reset_peak: bool = True):
        """Count arrays saved for backward inside the block (and until backward releases them).

        ``model``: its parameters' buffers are not counted (they are state, not activations).
        Hooks already active outside the block still see every array (this one hands them on), so
        accountants nest: an outer one counts what an inner one (a pipeline stage's) counts.
        """
        exclude = {}  # id -> the buffer itself (held, so its id cannot be reused by an activation)
        if model is not None:
            exclude = {id(r): r for r in (_root(p.data) for p in model.parameters())}
        if reset_peak:
            self.reset_peak()

        outer = current_saved_tensors_hooks()  # hand every array on, so an outer hook sees it too

        def pack(a):
            root = _root(a)
            held = outer[0](a) if outer else a
            if id(root) in exclude or not hasattr(root, "nbytes"):  # a parameter, or a Python scalar
                return _Saved(held, None)
            key = self._add(root)
            return _Saved(held, lambda: self._drop(key))

        def unpack(s):
            return outer[1](s.array) if outer else s.array

        with saved_tensors_hooks(pack, unpack):
            yield self

    # -- state between steps ---------------------------------------------------------------------
    def report(self, model, optimizer=None) -> dict:
        """Bytes this rank holds now: params, grads, optimizer_state, their total, and the activation
        peak seen by ``track_activations`` (0 if it was never used)."""
        arrays = state_arrays(model, optimizer)
        out = {k: storage_bytes(arrays.get(k, [])) for k in ("params", "grads", "optimizer_state")}
        out["total"] = out["params"] + out["grads"] + out["optimizer_state"]
        out["activations_peak"] = self.peak_activation_bytes
        return out


def zero_formula(stage: int, psi: int, n: int, p_bytes: int = 4, g_bytes: int = 4, k_bytes: int = 8) -> dict:
    """Bytes per rank the ZeRO paper predicts (stage 0 = plain DP), for the given element sizes.

    The paper's mixed-precision numbers are p=2, g=2, k=12 (fp32 master weights + Adam m, v):
    DP 16Ψ, ZeRO-1 4Ψ+12Ψ/N, ZeRO-2 2Ψ+14Ψ/N, ZeRO-3 16Ψ/N. Shards of uneven size round up.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0 (plain DP), 1, 2 or 3, got {stage}")
    for name, v, low in (("psi", psi, 0), ("n", n, 1), ("p_bytes", p_bytes, 0), ("g_bytes", g_bytes, 0),
                         ("k_bytes", k_bytes, 0)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
            raise ValueError(f"zero_formula: {name} must be an integer >= {low}, got {v!r}")
    shard = -(-psi // n)  # ceil: the largest rank's share
    params = p_bytes * (shard if stage >= 3 else psi)
    grads = g_bytes * (shard if stage >= 2 else psi)
    state = k_bytes * (shard if stage >= 1 else psi)
    return {"params": params, "grads": grads, "optimizer_state": state, "total": params + grads + state}
