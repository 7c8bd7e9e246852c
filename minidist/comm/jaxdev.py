"""The JAX device transport: ranks as threads of one process, each bound to one JAX device.

The threads transport (threads.py) with one difference: a JAX array sent with ``send``/``isend``
never visits the host. The sender ``jax.device_put``\\ s it onto the receiving rank's device (on a
TPU that copy crosses the inter-chip interconnect, on GPUs NVLink/PCIe peer-to-peer, on forced CPU
devices a memcpy) and drops the device array in the receiver's mailbox; ``recv`` hands it over as
it is. Rank r computes on device ``r % n`` (``jax.devices()``), exactly as ``bind_backend`` binds it.

Everything else is inherited unchanged: host NumPy buffers (what the collectives move, see
call.py) are copied as on the threads transport, so every collective and technique runs on this
transport as it is, and the ledger counts the same bytes (a device array's ``nbytes`` is its
host twin's). Select it with ``run(fn, ranks, transport="jax")`` or ``MINIDIST_TRANSPORT=jax``.
"""

from __future__ import annotations

import numpy as np

from minidist.comm.communicator import _Converted
from minidist.comm.threads import ThreadComm


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
        if self.backend.name != "jax":
            raise ValueError(f"rank {rank}: the jax device transport needs backend='jax' "
                             f"(got {self.backend.name!r}); run(..., transport='jax', backend='jax')")
        self.device = rank_device(self.world_rank)

    def copy_message(self, buf, dest: int):
        if _is_jax(buf):  # device to device: no host copy (JAX arrays are immutable: no defensive copy)
            import jax

            return jax.device_put(buf, rank_device(self.members[dest]))
        return super().copy_message(buf, dest)

    def isend(self, x, dest: int, tag: int = 0):
        if not _is_jax(x):
            return super().isend(x, dest, tag)
        dest, tag = self.check_peer(dest, "dest"), self._check_tag(tag)
        self.note(f"send to {dest} tag {tag}")
        return self.isend_buffer(x, dest, tag, header=True)

    def _arrived(self, a):
        """A device array (already on this rank's device) as it is; a host array onto the device."""
        return a if _is_jax(a) else self.backend.from_host(np.asarray(a))

    def irecv(self, source: int, tag: int = 0, out=None):
        if out is not None and not _is_jax(out):
            return super().irecv(source, tag, out)  # a NumPy out= buffer: filled on the host
        source, tag = self.check_peer(source, "source"), self._check_tag(tag)
        self.note(f"recv from {source} tag {tag}")
        req = self.irecv_buffer(None, source, tag, header=True)
        if out is None:
            return _Converted(req, self._arrived)
        be = self.backend
        return _Converted(req, lambda a: be.update(out, self._arrived(a)))

    def make_twin(self, name: str) -> JaxDeviceComm:
        return JaxDeviceComm(self.world, (*self.ctx, "twin", name), self.members, self.rank,
                             self.backend, self.ledger)

    def split(self, color, key=0):
        sub = super().split(color, key)
        if sub is None:
            return None
        return JaxDeviceComm(sub.world, sub.ctx, sub.members, sub.rank, sub.backend, sub.ledger)
