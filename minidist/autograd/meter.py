"""The op meter: the seam through which something watches each op run (``Function.apply`` forward,
the backward walk). The virtual clock's device model installs one to price every op by its FLOPs
and bytes (``minidist.comm.clock``); without one, each op pays a single global lookup."""

from __future__ import annotations

METER = None  # fn(op class, inputs, output, backward: bool); backward: (output grad,), input grads


def install(fn) -> None:
    """Watch every op with ``fn`` from now on (None: nobody)."""
    global METER
    METER = fn
