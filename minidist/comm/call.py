"""One collective call: what every algorithm in collectives.py does before and after its messages.

``with collective(comm, "ring_all_reduce", x, op=op) as k:`` opens the call and hands the algorithm
everything it needs, so the algorithm's body is only its messages:

* ``k.comm`` -- the communicator's strict private channel (``comm.twin("coll")``): collectives never
  match a user's point-to-point messages;
* ``k.tag`` -- this call's stamp (debug.py): kind, call number, dtype, op/root. Send and receive
  with it; a peer in another call is caught while waiting;
* ``k.host`` / ``k.flat`` -- x staged to a contiguous NumPy host array (flat: 1-D view), any backend;
* ``k.rec`` -- the ledger record: the algorithm calls ``k.rec.step()`` once per round;
* ``k.result(buf)`` -- back to the caller: divide by p for ``op="mean"``, x's shape, x's backend.

Opening counts the call (``comm.seq``), checks ``op``, in debug mode compares every rank's full
signature before any message, notes the call for the watchdog and records a trace span.
A collective called inside another joins the outer call. (A class, not a generator: it runs on
every call and must stay cheap.)
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of, get_backend
from minidist.comm import debug, tracing
from minidist.comm.debug import check_same_call, stamp
from minidist.comm.ledger import CallRecord, active
from minidist.trace import spans as trace  # the thread-local state: ever_set

OPS = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}
_NUMPY = get_backend("numpy")


def is_floating(dtype) -> bool:
    """True for NumPy's float/complex dtypes and for ml_dtypes' (bfloat16, float8_*): those are
    NumPy 'V' kinds, so ``np.issubdtype(bfloat16, np.floating)`` is False."""
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
    """Nothing watches a collective call on ``comm`` beyond the ledger's totals: no debug mode, no
    tracing, no outer collective that it would join. A lean path may then skip ``collective``."""
    # (active.__dict__, not getattr: a getattr that misses raises and catches AttributeError inside,
    # in every thread that never set active.rec)
    return not comm.debug and not trace.ever_set and active.__dict__.get("rec") is None


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
        outer = getattr(active, "rec", None)  # (ledger.current_call, inlined: this runs every call)
        if outer is not None:
            self.outer = outer.call
            return self.outer
        self.outer = None
        user = self.user
        self.comm = user.twins.get("coll") or user.twin("coll")
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
        n, d, o, r, rest = debug._last  # stamp()'s fast path, inlined: the same kind of call as the last
        if n is self.name and d is dtype and o is self.op and r == self.root:
            self.tag = ((seq & 0xFF) << 12) | rest
        else:
            self.tag = stamp(self.name, seq, dtype, self.op, self.root)
        self.rec = CallRecord(self.name, 0, 0, 0, 0, self)
        self.span = span = tracing.span(self.name, "collective")
        if span is not tracing.NULL:  # tracing off (the usual case): nothing to enter
            span.__enter__()
        active.rec = self.rec
        user.note((self.name, seq))
        if user.debug and user.size > 1:
            try:
                check_same_call(user, self.signature())
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc):
        if self.outer is None:
            active.rec = None
            self.user.ledger.finish_call(self.rec)
            if self.span is not tracing.NULL:
                self.span.__exit__(*exc)
        return False

    def finish(self, buf: np.ndarray) -> np.ndarray:
        """``op="mean"``: divide the sum by p, in place."""
        if self.op == "mean":
            buf /= self.user.size
        return buf

    def result(self, buf: np.ndarray):
        """``buf`` (this rank's all-reduced x on the host) back to the caller: finished (as
        ``finish``), in x's shape and x's backend."""
        if self.op == "mean":
            buf /= self.user.size
        return self.be.from_host(buf.reshape(self.host.shape))
