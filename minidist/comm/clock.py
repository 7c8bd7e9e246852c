"""The virtual clock: each rank keeps the time the cluster it emulates would (SimGrid SMPI's model).

``MINIDIST_CLOCK=virtual`` (a lesson's ``--clock virtual``) gives every rank a ``RankClock``:

* **compute** advances it by the CPU time its thread really used (``time.thread_time``): a rank
  that waits for a free core, or for the GIL, is not charged; time inside the transport is not
  compute and is not charged either;
* **a message** of n bytes leaves when the sender's link is free and arrives ``alpha + n/beta``
  later (``transports/link.Link``: ``MINIDIST_LINK``, default this machine's shared memory);
  the sender's link is busy ``n/beta`` (a blocking send waits that long);
* **a receive** completes at the later of the receiver's clock and the message's arrival;
* each thread acting for a rank has its own lane of the clock (the async worker's collectives run
  beside the compute, as a NIC does); a job starts no earlier than its submission and ``wait()``
  joins its end;
* ``MINIDIST_DEVICE`` (a lesson's ``--device NAME``): compute costs a device model's time instead,
  each op its FLOPs and bytes under the roofline (``work``), and the CPU time is not charged.

The transports call ``send``, ``pause`` and ``resume``; ``trace.clock.now()`` reads ``now``.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from minidist.autograd import meter
from minidist.autograd.ops import Linear, Matmul, PackedAttention, ScaledDotProductAttention
from minidist.comm import cost
from minidist.comm.transports.link import Link, current_link
from minidist.trace import clock as trace_clock

_thread_time = time.thread_time
_local = threading.local()  # .clock: the RankClock this thread acts for (adopt_thread)


def enabled() -> bool:
    """Does this process run on the virtual clock (``MINIDIST_CLOCK=virtual``)?"""
    mode = os.environ.get("MINIDIST_CLOCK", "wall")
    if mode not in ("wall", "virtual"):
        raise ValueError(f"MINIDIST_CLOCK={mode!r}: use 'wall' (the default) or 'virtual'")
    return mode == "virtual"


class Device:
    """A device model: ``flops`` FLOP/s, ``bandwidth`` bytes/s of memory, ``overhead`` s per op."""

    def __init__(self, flops: float, bandwidth: float, overhead: float = 0.0, name: str = ""):
        self.flops, self.bandwidth, self.overhead, self.name = flops, bandwidth, overhead, name

    def op_time(self, flops: float, nbytes: float) -> float:
        """The roofline: an op takes the longer of its math and its memory traffic, plus the overhead."""
        return self.overhead + max(flops / self.flops, nbytes / self.bandwidth)

    def __str__(self):
        return (f"{self.name or 'device'}: {self.flops / 1e12:g} TFLOP/s, {self.bandwidth / 1e9:g} GB/s, "
                f"{self.overhead * 1e6:g} us per op")


def parse_device(spec: str | None) -> Device | None:
    """ "tflops=989,gBps=3350,overhead_us=5,name=H100" -> Device; "" or None -> None (CPU time)."""
    if not spec:
        return None
    fields = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    try:
        return Device(float(fields["tflops"]) * 1e12, float(fields["gBps"]) * 1e9,
                      float(fields.get("overhead_us", 0)) * 1e-6, fields.get("name", ""))
    except (KeyError, ValueError):
        raise ValueError(f"MINIDIST_DEVICE={spec!r}: expected e.g. 'tflops=989,gBps=3350,overhead_us=5' "
                         f"(a lesson's --device NAME writes it)") from None


def default_link() -> Link:
    """The link messages are charged on: ``MINIDIST_LINK``, else this machine's shared memory as
    the cost model prices it (alpha for a core per rank, 1/beta bytes per second)."""
    return current_link() or Link(cost.LATENCY[False][0], 1 / cost.BETA)


class _Lane:
    __slots__ = ("t", "mark")

    def __init__(self, t: float):
        self.t, self.mark = t, _thread_time()


class RankClock:
    """One rank's virtual time: a lane per thread acting for the rank, one outgoing link."""

    def __init__(self, link: Link | None = None, device: Device | None = None):
        self.link = link or default_link()
        self.device = device if device is not None else parse_device(os.environ.get("MINIDIST_DEVICE"))
        self.link_free = 0.0        # when this rank's outgoing link has pushed its last byte
        self.lanes: dict = {}       # thread id -> _Lane
        self._lock = threading.Lock()

    def adopt_thread(self) -> None:
        """This thread acts for the rank from now on: ``trace.clock.now()`` reads its lane (and,
        under a device model, its ops are charged to it). What it acted for before (a rank that
        starts a ``run`` of its own) comes back at ``release_thread``."""
        outer = _local.__dict__.setdefault("outer", [])
        outer.append((*trace_clock.current(), getattr(_local, "clock", None)))
        trace_clock.use(self.now, self.advance)
        _local.clock = self
        if self.device is not None:
            meter.install(charge_op)

    @staticmethod
    def release_thread() -> None:
        """This thread no longer acts for this rank: the rank it acted for before (a nested ``run``),
        else wall time again and its ops charged to nobody."""
        outer = getattr(_local, "outer", None)
        source, advance, clock = outer.pop() if outer else (None, None, None)
        trace_clock.use(source, advance)
        _local.clock = clock

    def lane(self) -> _Lane:
        lane = self.lanes.get(threading.get_ident())
        if lane is None:
            lane = self.lanes[threading.get_ident()] = _Lane(0.0)
        return lane

    def now(self) -> float:
        """This thread's virtual seconds, with the compute since the last look charged (CPU time;
        under a device model its ops were charged as they ran, by ``work``)."""
        lane = self.lane()
        mark = _thread_time()
        if self.device is None:
            lane.t += mark - lane.mark
        lane.mark = mark
        return lane.t

    def work(self, flops: float, nbytes: float) -> None:
        """An op of ``flops`` and ``nbytes`` ran: under a device model it costs the roofline's time."""
        if self.device is not None:
            self.lane().t += self.device.op_time(flops, nbytes)

    def pause(self) -> float:
        """Charge the compute so far and stop charging: communication starts (returns the time)."""
        return self.now()

    def resume(self, at: float = 0.0) -> None:
        """Communication ends at virtual time ``at`` (or now): charge compute again from here."""
        lane = self.lane()
        lane.t = max(lane.t, at)
        lane.mark = _thread_time()

    def advance(self, seconds: float) -> None:
        """Work the clock cannot see (an emulated straggler, a device model's op): ``seconds`` more."""
        self.now()
        self.lane().t += seconds

    def send(self, nbytes: int) -> tuple[float, float]:
        """A message leaves now: (when the sender's link is done with it, when it arrives)."""
        t = self.now()
        busy = nbytes / self.link.bandwidth
        with self._lock:
            depart = max(t, self.link_free)
            self.link_free = depart + busy
        return depart + busy, depart + self.link.alpha + busy

    def aside(self, wait) -> float:
        """Call ``wait()`` (a message's wait) without moving this thread's time; returns the time it
        would have reached: the message's arrival, or now if it arrived earlier. A rank can then
        take a message only once its clock has reached the arrival, however fast the host ran."""
        t = self.now()
        wait()
        reached, lane = self.now(), self.lane()
        lane.t, lane.mark = t, _thread_time()
        return reached

    def start_job(self, ready: float) -> None:
        """A background job submitted at ``ready`` starts on this thread's lane."""
        self.resume(ready)


def op_work(op, ins, outs, backward: bool) -> tuple[float, float] | None:
    """(FLOPs, bytes) of one op from its arrays' shapes. Forward: a product's 2·M·K·N (attention's
    two, 4·B·H·Tq·Tk·D), one FLOP per output element for the rest. Backward (``ins`` = the output's
    gradient g, ``outs`` = the inputs' gradients): each input gradient of a product is a product of
    g's size times K. Bytes: every array read or written. None -- no work, not even an op's overhead --
    for a view (a reshape, a transpose, a slice: NumPy moves no data, and a device would launch
    nothing) or a ``composite`` op (``Recompute``: the ops it runs are priced themselves)."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    done = [a for a in outs if a is not None]
    if getattr(op, "composite", False) or done and all(_view(a, ins) for a in done):
        return None
    nbytes = float(sum(a.nbytes for a in (*ins, *done) if hasattr(a, "nbytes")))
    if not done or not hasattr(ins[0], "shape"):
        return 0.0, nbytes
    x, y = ins[0], done[0]
    if issubclass(op, (Linear, Matmul)):
        if not backward:
            return 2.0 * y.size * x.shape[-1], nbytes
        da, db = outs[0], outs[1] if len(outs) > 1 else None  # g (..., N); da (..., K); db (.., K, N)
        k = da.shape[-1] if da is not None else db.shape[-2]
        return 2.0 * x.size * k * ((da is not None) + (db is not None)), nbytes
    if issubclass(op, ScaledDotProductAttention):  # q (B, H, Tq, D), k (B, H, Tk, D)
        return (8.0 * x.size * outs[1].shape[-2] if backward else 4.0 * y.size * ins[1].shape[-2]), nbytes
    if issubclass(op, PackedAttention):  # qkv (B, T, 3C) -> (B, T, C)
        return (8.0 * x.size * x.shape[-2] if backward else 4.0 * y.size * y.shape[-2]), nbytes
    return float(sum(a.size for a in done)), nbytes


def _view(a, ins) -> bool:
    """Is NumPy array ``a`` a view of one of ``ins`` (shares its memory)?"""
    return isinstance(a, np.ndarray) and any(isinstance(x, np.ndarray) and np.may_share_memory(a, x)
                                             for x in ins)


def charge_op(op, ins, outs, backward: bool) -> None:
    """The meter a device model installs: each op costs its roofline time on the thread's rank. An
    op ``priced_elsewhere`` is not charged as a whole: a communication op (the link prices it) or
    one that meters its parts as they run (collective matmul's GEMM chunks, between its hops)."""
    clock = getattr(_local, "clock", None)
    if clock is None or getattr(op, "priced_elsewhere", False):
        return
    work = op_work(op, ins, outs, backward)
    if work is not None:
        clock.work(*work)
