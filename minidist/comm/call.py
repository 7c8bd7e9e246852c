"""One collective call: what every algorithm does before and after its messages, so its body is
only the messages.

``with collective(comm, "ring_all_reduce", x, op=op) as k:`` hands the algorithm:

* ``k.comm`` -- the communicator's strict private channel (``comm.channel("coll")``): collectives
  never match a user's point-to-point messages;
* ``k.tag`` -- this call's stamp: kind, call number, dtype, op/root packed into a tag. Every
  message of the call travels under it, so a peer in another call is caught while waiting;
* ``k.host`` / ``k.flat`` -- x staged to a contiguous NumPy host array (flat: 1-D view), any backend;
* ``k.step()`` -- once per communication round (the ledger counts rounds);
* ``k.result(buf)`` -- back to the caller: divided by p for ``op="mean"``, x's shape and backend.

Machinery attaches here and nowhere in the algorithms: the communicator's ledger records the call
(ledger.py), a tracer gets a span (``trace.spans``), debug mode compares every rank's call first
(``comm.check_same_call``). A collective called inside another joins the outer call.
"""

from __future__ import annotations

import threading

import numpy as np

from minidist.accel.backend import backend_of, get_backend
from minidist.trace import spans

OPS = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}
_NUMPY = get_backend("numpy")
_active = threading.local()  # .call: the collective open on this thread (rank)


def current():
    """The collective call open on this thread (rank), or None."""
    return _active.__dict__.get("call")  # (not getattr: a miss would raise and catch inside)


def is_floating(dtype) -> bool:
    """True for NumPy's float/complex dtypes and for ml_dtypes' (bfloat16, float8_*), which NumPy
    sees as 'V' kinds."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.inexact):
        return True
    if dtype.kind != "V":
        return False
    try:
        import ml_dtypes

        ml_dtypes.finfo(dtype)
        return True
    except (ImportError, ValueError, TypeError):
        return False


def check_op(comm, op, dtype) -> None:
    if op not in OPS:
        raise ValueError(f"rank {comm.rank}: unknown op {op!r}; use one of {', '.join(OPS)}")
    if op == "mean" and not is_floating(dtype):
        raise TypeError(f"rank {comm.rank}: op='mean' needs a floating dtype, got {dtype}; use op='sum'")


def unwatched(comm) -> bool:
    """Nothing watches a call on ``comm`` beyond the ledger's totals (no debug mode, no tracing, no
    outer call to join): a lean path (shm.py) may skip ``collective``."""
    return not comm.debug and not spans.ever_set and current() is None


def result_backend(comm, x):
    """The backend to return results in: the rank's own (device-bound) one if x is of that kind."""
    if type(x) is np.ndarray:
        return comm.backend if comm.backend.name == "numpy" else _NUMPY
    be = backend_of(x)
    return comm.backend if comm.backend.name == be.name else be


def scratch(c, n: int, dtype) -> np.ndarray:
    """A reusable work buffer of ``n`` elements (fresh large arrays cost page faults every call)."""
    buf = c.scratch.get(dtype)
    if buf is None or buf.size < n:
        buf = c.scratch[dtype] = np.empty(n, dtype)
    return buf[:n]


# -- the stamp: bits 12-19 call number (mod 256), 7-11 kind, 3-6 dtype, 1-2 op or root mod 4, 0 phase
KINDS = ("?", "ring_all_reduce", "recursive_doubling_all_reduce", "halving_doubling_all_reduce",
         "two_shot_all_reduce", "tree_all_reduce", "naive_all_reduce", "mpi_all_reduce", "reduce_scatter",
         "all_gather", "broadcast", "reduce", "all_to_all", "gather", "scatter", "shm_all_reduce")
DTYPES = ("any", "bool", "int8", "uint8", "int16", "int32", "int64", "uint32", "uint64", "float16",
          "bfloat16", "float32", "float64", "complex64", "complex128", "other")
_KIND = {k: i for i, k in enumerate(KINDS)}
_DTYPE: dict = {}
_last: tuple = (None, None, None, None, 0)  # the last kind of call stamped: a repeat costs 4 checks


def stamp(name: str, seq: int, dtype=None, op: str | None = None, root: int | None = None) -> int:
    """The tag of collective call number ``seq`` (below the user tags' limit, phase bit clear)."""
    global _last
    n, d, o, r, rest = _last
    if not (n is name and d is dtype and o is op and r == root):
        code = _DTYPE.get(dtype)
        if code is None and dtype is not None:
            name_ = np.dtype(dtype).name
            code = _DTYPE[dtype] = DTYPES.index(name_) if name_ in DTYPES else len(DTYPES) - 1
        extra = list(OPS).index(op) if op in OPS else (root & 3 if root is not None else 0)
        rest = (_KIND.get(name, 0) << 7) | ((code or 0) << 3) | (extra << 1)
        _last = (name, dtype, op, root, rest)
    return ((seq & 0xFF) << 12) | rest


class collective:
    """``with collective(comm, name, x, op=..., root=...) as k:`` -- one collective call (see above).

    ``typed=False``: the ranks' dtypes may differ or be unknown (broadcast's receivers pass None),
    so the stamp leaves dtype out. ``shape_key`` maps x's shape to what must agree in debug mode;
    ``extra`` goes into the debug signature.
    """

    __slots__ = ("user", "name", "x", "op", "root", "typed", "shape_key", "extra", "outer", "comm", "be",
                 "host", "flat", "tag", "rec", "span")

    def __init__(self, comm, name: str, x=None, op: str | None = None, root: int | None = None,
                 typed: bool = True, shape_key=None, **extra):
        self.user, self.name, self.x, self.op, self.root = comm, name, x, op, root
        self.typed, self.shape_key, self.extra = typed, shape_key, extra

    def signature(self) -> dict:
        sig = {"collective": self.name, "seq": self.user.seq, "size": self.user.size}
        if self.x is not None:
            shape = tuple(np.shape(self.x))
            sig["shape"] = shape if self.shape_key is None else self.shape_key(shape)
            sig["dtype"] = str(self.x.dtype)
        for k in ("op", "root"):
            if getattr(self, k) is not None:
                sig[k] = getattr(self, k)
        return sig | self.extra

    def __enter__(self):
        outer = _active.__dict__.get("call")
        if outer is not None:
            self.outer = outer
            return outer
        self.outer = None
        user = self.user
        self.comm = user.channels.get("coll") or user.channel("coll")
        x = self.x
        if x is not None:
            self.be = result_backend(user, x)
            h = self.be.to_host(x)
            self.host = np.ascontiguousarray(h) if h.ndim else h  # (ascontiguousarray makes 0-d 1-d)
            self.flat = self.host.reshape(-1)
            if self.op is not None:
                check_op(user, self.op, self.host.dtype)
        user.seq = seq = user.seq + 1
        dtype = x.dtype if self.typed and x is not None else None
        self.tag = stamp(self.name, seq, dtype, self.op, self.root)
        self.rec = None if user.ledger is None else user.ledger.open_call(self.name)
        self.span = spans.span(self.name, "collective") if spans.ever_set else None
        if self.span is not None:
            self.span.__enter__()
        _active.call = self
        user.note((self.name, seq))
        if user.debug and user.size > 1:
            try:
                user.check_same_call(self.signature())
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc):
        if self.outer is None:
            _active.call = None
            if self.rec is not None:
                self.user.ledger.finish_call(self.rec)
            if self.span is not None:
                self.span.__exit__(*exc)
        return False

    def step(self, n: int = 1) -> None:
        """Count ``n`` communication rounds of this call (the ledger's ``steps``)."""
        if self.rec is not None:
            self.rec.steps += n

    def finish(self, buf: np.ndarray) -> np.ndarray:
        """``op="mean"``: divide the sum by p, in place."""
        if self.op == "mean":
            buf /= self.user.size
        return buf

    def result(self, buf: np.ndarray):
        """This rank's all-reduced x on the host, back to the caller: finished, x's shape and backend."""
        if self.op == "mean":
            buf /= self.user.size
        return self.be.from_host(buf.reshape(self.host.shape))
