"""The JAX device transport: ranks as threads of one process, each bound to one JAX device.

The threads transport (threads.py) with one difference: a JAX array sent with ``send``/``isend``
never visits the host. The sender ``jax.device_put``\\ s it onto the receiving rank's device (on a
TPU that copy crosses the inter-chip interconnect, on GPUs NVLink/PCIe peer-to-peer, on forced CPU
devices a memcpy) and drops the device array in the receiver's mailbox; ``recv`` hands it over as
it is. Rank r computes on device ``r % n`` (``jax.devices()``), exactly as ``bind_backend`` binds it.

Everything else is inherited unchanged: host NumPy buffers (what the collectives move, see
call.py) are copied as on the threads transport, so every collective and technique runs on this
transport as it is, and the ledger counts the same bytes (a device array's ``nbytes`` is its
host copy's). Select it with ``run(fn, ranks, transport="jax")`` or ``MINIDIST_TRANSPORT=jax``.

``CupyDeviceComm`` is the same idea for CuPy (``transport="cupy"``): rank r on GPU r mod n, a
CuPy array copied GPU to GPU (peer-to-peer over NVLink/PCIe where the GPUs allow it) with
``cupy.asarray`` under the receiver's device.
"""

from __future__ import annotations

import numpy as np

from minidist.comm.requests import Converted as _Converted
from minidist.comm.transports.threads import ThreadComm


def _is_jax(x) -> bool:
    mod = type(x).__module__
    return mod.startswith(("jax", "jaxlib"))


def rank_device(world_rank: int):
    """The JAX device of world rank ``world_rank``: device ``world_rank % n``."""
    import jax

    devices = jax.devices()
    return devices[world_rank % len(devices)]


class JaxDeviceComm(ThreadComm):
    """One rank's end of a group of threads whose point-to-point arrays move device to device."""

    transport = "jax"

    def __init__(self, world, ctx, members, rank, backend=None, ledger=None):
        super().__init__(world, ctx, members, rank, backend, ledger)
        if self.backend.name != self.transport:
            raise ValueError(f"rank {rank}: the {self.transport} device transport needs backend="
                             f"'{self.transport}' (got {self.backend.name!r}); run(..., transport="
                             f"'{self.transport}', backend='{self.transport}')")
        self.device = self.device_of(self.world_rank)

    # -- what differs between the array libraries ----------------------------------------------
    def device_of(self, world_rank: int):
        return rank_device(world_rank)

    def is_device_array(self, x) -> bool:
        return _is_jax(x)

    def move(self, x, world_rank: int):
        """``x`` on world rank ``world_rank``'s device (JAX arrays are immutable: no defensive copy)."""
        import jax

        return jax.device_put(x, rank_device(world_rank))

    # -- the transport ---------------------------------------------------------------------------
    def copy_message(self, buf, dest: int):
        if self.is_device_array(buf):  # device to device: no host copy
            return self.move(buf, self.members[dest])
        return super().copy_message(buf, dest)

    def isend(self, x, dest: int, tag: int = 0):
        if not self.is_device_array(x):
            return super().isend(x, dest, tag)
        dest, tag = self.check_peer(dest, "dest"), self._check_tag(tag)
        self.note(f"send to {dest} tag {tag}")
        return self.isend_buffer(x, dest, tag, header=True)

    def _arrived(self, a):
        """A device array (already on this rank's device) as it is; a host array onto the device."""
        return a if self.is_device_array(a) else self.backend.from_host(np.asarray(a))

    def irecv(self, source: int, tag: int = 0, out=None):
        if out is not None and not self.is_device_array(out):
            return super().irecv(source, tag, out)  # a NumPy out= buffer: filled on the host
        source, tag = self.check_peer(source, "source"), self._check_tag(tag)
        self.note(f"recv from {source} tag {tag}")
        req = self.irecv_buffer(None, source, tag, header=True)
        if out is None:
            return _Converted(req, self._arrived)
        be = self.backend
        return _Converted(req, lambda a: be.update(out, self._arrived(a)))

    def make_channel(self, name: str) -> JaxDeviceComm:
        return type(self)(self.world, (*self.ctx, "channel", name), self.members, self.rank,
                          self.backend, self.ledger)

    def split(self, color, key=0):
        sub = super().split(color, key)
        if sub is None:
            return None
        return type(self)(sub.world, sub.ctx, sub.members, sub.rank, sub.backend, sub.ledger)


class CupyDeviceComm(JaxDeviceComm):
    """The same transport for CuPy: rank r on GPU r mod n, arrays copied GPU to GPU."""

    transport = "cupy"

    def device_of(self, world_rank: int) -> int:
        import cupy

        return world_rank % cupy.cuda.runtime.getDeviceCount()

    def is_device_array(self, x) -> bool:
        return type(x).__module__.startswith("cupy")

    def move(self, x, world_rank: int):
        """A copy on the receiver's GPU (the sender may reuse ``x``): peer-to-peer where enabled.

        On one GPU (ranks sharing it) this is a device-to-device copy, ordered after the kernels
        that made ``x`` because both go to the same stream. Across GPUs CuPy enqueues the copy on
        the *receiver's* stream, which does not wait for the sender's, nor the sender's for it:
        so the receiver waits for an event recorded on the sender's stream before the copy, and
        the sender's stream waits for an event recorded after it. Without the second wait the
        sender's next kernel may overwrite ``x`` (or, when ``x`` was not contiguous, reuse the
        pooled memory of the contiguous temporary, freed when this returns) while the copy still
        reads it. CuPy copies only contiguous arrays between devices, hence the temporary."""
        import cupy

        src, dst = x.device.id, self.device_of(world_rank)
        if src == dst:
            with cupy.cuda.Device(dst):
                return cupy.array(x, copy=True)
        with cupy.cuda.Device(src):
            x = cupy.ascontiguousarray(x)  # may be a temporary: alive until the sender waits below
            sender = cupy.cuda.get_current_stream()
            made = sender.record()
        with cupy.cuda.Device(dst):
            receiver = cupy.cuda.get_current_stream()
            receiver.wait_event(made)
            y = cupy.array(x, copy=True)
            copied = receiver.record()
        with cupy.cuda.Device(src):
            sender.wait_event(copied)  # later work on the sender's stream (and pool reuse) comes after
        return y
