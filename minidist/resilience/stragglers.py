"""Emulated imbalance: make one rank's compute (or one layer's) slower by a factor, from a step on.

``MINIDIST_SLOW`` (or a lesson's ``--slow``) lists slowdowns separated by ``;``::

    MINIDIST_SLOW="rank=2,factor=3,from_step=5"     # rank 2 computes 3x slower from step 5 on
    MINIDIST_SLOW="layer=3,factor=4"                 # pipeline layer 3 costs 4x (every step)

A slowdown is emulated by *measuring* the slowed work on the rank's clock (``trace.clock``) and then
letting ``(factor - 1)`` times as long pass (``trace.clock.sleep``: charged to the virtual clock
under ``--clock virtual``, slept on the wall clock), so the work takes ``factor`` times its duration
on any transport (threads or MPI processes) and any machine, and it can appear mid-run
(``from_step``): the dynamic case a load balancer has to notice. Sleeping also releases the GIL, so
on the threads transport the other ranks keep computing meanwhile, as they would on their own devices.

``Slowdown.compute(rank, step)`` wraps a rank's compute of one step; ``Slowdown.layer_factor(i)``
is the multiplier a profiled pipeline stage applies to layer ``i``. ``pace`` (seconds per row)
emulates a device with a fixed speed, so that a machine with fewer cores than ranks still shows
clean, reproducible timings.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from minidist.trace.spans import now, sleep

KEYS = ("rank", "layer", "factor", "from_step")


@dataclass(frozen=True)
class Slow:
    """One slowdown: ``rank`` (or pipeline ``layer``) runs ``factor`` x slower from ``from_step`` on."""
    factor: float
    rank: int | None = None
    layer: int | None = None
    from_step: int = 0

    def applies(self, step: int) -> bool:
        return step >= self.from_step


def parse(spec: str) -> list[Slow]:
    """The slowdowns of a ``MINIDIST_SLOW`` string; a clear ValueError for a malformed one."""
    out = []
    for part in [p.strip() for p in (spec or "").split(";") if p.strip()]:
        kv = {}
        for item in part.split(","):
            key, eq, value = item.strip().partition("=")
            if not eq or key not in KEYS:
                raise ValueError(f"MINIDIST_SLOW: bad item {item.strip()!r} in {part!r}; use "
                                 "rank=R or layer=L, factor=F (> 1), from_step=S, e.g. "
                                 "'rank=2,factor=3,from_step=5'")
            try:
                kv[key] = float(value) if key == "factor" else int(value)
            except ValueError:
                raise ValueError(f"MINIDIST_SLOW: {key}={value!r} in {part!r} is not a number") from None
        if ("rank" in kv) == ("layer" in kv):
            raise ValueError(f"MINIDIST_SLOW: {part!r} must name exactly one of rank=R or layer=L")
        factor = kv.get("factor")
        if factor is None or not factor >= 1.0 or factor != factor or factor == float("inf"):
            raise ValueError(f"MINIDIST_SLOW: {part!r} needs factor=F with a finite F >= 1")
        if kv.get("from_step", 0) < 0 or kv.get("rank", 0) < 0 or kv.get("layer", 0) < 0:
            raise ValueError(f"MINIDIST_SLOW: {part!r}: rank, layer and from_step must be >= 0")
        out.append(Slow(factor=factor, rank=kv.get("rank"), layer=kv.get("layer"),
                        from_step=kv.get("from_step", 0)))
    return out


class Slowdown:
    """The slowdowns in effect: from ``spec`` (a string or a list of ``Slow``), else ``$MINIDIST_SLOW``."""

    def __init__(self, spec=None, pace: float = 0.0):
        if spec is None:
            spec = os.environ.get("MINIDIST_SLOW", "")
        self.slows = parse(spec) if isinstance(spec, str) else list(spec)
        if not pace >= 0:
            raise ValueError(f"Slowdown: pace must be seconds per row >= 0, got {pace!r}")
        self.pace = float(pace)

    def check_world(self, size: int, num_layers: int | None = None, rank: int = 0) -> None:
        """A slowdown naming a rank or layer that does not exist is an error, not a silent no-op."""
        for s in self.slows:
            if s.rank is not None and s.rank >= size:
                raise ValueError(f"rank {rank}: MINIDIST_SLOW slows rank {s.rank}, but there are only "
                                 f"{size} ranks (0..{size - 1})")
            if s.layer is not None and num_layers is not None and s.layer >= num_layers:
                raise ValueError(f"rank {rank}: MINIDIST_SLOW slows layer {s.layer}, but the model has "
                                 f"{num_layers} layers (0..{num_layers - 1})")

    def rank_factor(self, rank: int, step: int) -> float:
        f = 1.0
        for s in self.slows:
            if s.rank == rank and s.applies(step):
                f *= s.factor
        return f

    def layer_factor(self, layer: int, step: int = 0) -> float:
        f = 1.0
        for s in self.slows:
            if s.layer == layer and s.applies(step):
                f *= s.factor
        return f

    @contextlib.contextmanager
    def compute(self, rank: int, step: int, rows: int = 0):
        """Time the block (the rank's clock); then let time pass so that it took ``rank_factor(rank,
        step)`` times as long.

        With ``pace`` > 0 the block first lasts at least ``rows * pace`` seconds: an emulated device
        that needs ``pace`` seconds per row while the host waits (as for a GPU kernel). On a laptop
        with fewer cores than ranks, ranks' real compute contends for the cores and is noisy; the
        paced time is not, so a lesson's numbers are reproducible. Real work still runs inside."""
        t0 = now()
        yield
        spent = now() - t0
        sleep_until(t0, self.target(spent, rows, self.rank_factor(rank, step)))

    def target(self, spent: float, rows: int, factor: float) -> float:
        """How long work that really took ``spent`` seconds for ``rows`` rows lasts when emulated:
        ``factor * max(spent, rows * pace)``."""
        return factor * max(spent, rows * self.pace)

    def __bool__(self):
        return bool(self.slows)

    def __repr__(self):
        return f"Slowdown({self.slows})"


def sleep_until(t0: float, seconds: float) -> None:
    """Let time pass until ``seconds`` have since ``t0`` (a ``trace.clock.now()``), if they have not:
    the virtual clock is charged, the wall clock slept."""
    sleep(t0 + seconds - now())
