"""Measure the bytes of activations saved for backward, live and at their peak.

``ActivationMeter`` installs a ``saved_tensors_hooks`` pair: every array an op saves is wrapped in
a small ``_Saved`` box that adds its bytes to the live total when it is made and subtracts them when
the box is freed (the engine drops a node's saved arrays as soon as that node's backward has run).
The peak of the live total is the activation memory a step needs. Parameters that ops save (a
Linear keeps its weight) are not activations: pass them as ``exclude``. The same array saved by
two ops is counted once. Arrays saved while gradients are off (a checkpointed forward) are not
counted: nothing keeps them. (``minidist.memory.MemoryAccountant`` by the data-parallel chapter
tracks parameters, gradients and optimizer state too; this meter is the activation part alone.)
"""

from __future__ import annotations

import contextlib
import threading

from minidist.tensor import grad_enabled, saved_tensors_hooks


class _Saved:
    __slots__ = ("array", "meter", "key", "__weakref__")

    def __init__(self, meter, array):
        self.array, self.meter, self.key = array, meter, id(array)
        meter._add(self.key, int(array.nbytes))

    def __del__(self):
        self.meter._drop(self.key)


class ActivationMeter:
    """Live and peak bytes of saved activations on this rank: ``with meter.track(): loss.backward()``."""

    def __init__(self, exclude=()):
        self.exclude = {id(getattr(p, "data", p)) for p in exclude}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._count: dict[int, list] = {}
        self._lock = threading.Lock()

    def _add(self, key, nbytes):
        with self._lock:
            entry = self._count.get(key)
            if entry is None:
                self._count[key] = [nbytes, 1]
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            else:
                entry[1] += 1

    def _drop(self, key):
        with self._lock:
            entry = self._count[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._count[key]
                self.live_bytes -= entry[0]

    def _pack(self, array):
        if not grad_enabled() or id(array) in self.exclude:
            return array
        return _Saved(self, array)

    @staticmethod
    def _unpack(box):
        return box.array if isinstance(box, _Saved) else box

    def reset_peak(self):
        self.peak_bytes = self.live_bytes

    @contextlib.contextmanager
    def track(self):
        """Count every array saved for backward inside the block (forward and backward both)."""
        with saved_tensors_hooks(self._pack, self._unpack):
            yield self
