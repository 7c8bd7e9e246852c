"""``ProfiledStage``: a pipeline stage that times each of its layers while it trains.

Forward is timed directly; backward with gradient hooks on each layer's output: the hook on y_i
fires when layer i's backward can start, the one on y_{i-1} when it is done. A first layer fed by
tokens has no input gradient to hook, so its backward is estimated as 2x its forward. These
per-layer seconds (and each layer's largest activation) are what the re-partitioning decides from.

``slow`` (a ``minidist.resilience.stragglers.Slowdown``, or None: nothing slowed) emulates a skew:
``slow.layer_factor(i, step)`` stretches layer i's forward and backward, and ``slow.pace`` makes
every layer's forward last at least rows x pace (an emulated device: clean timings on any machine).
Times are the rank's clock (``trace.clock``); the stretch is charged to it under ``--clock virtual``.
"""

from __future__ import annotations

from minidist.autograd.tensor import Tensor
from minidist.parallel.pipeline.stage import PipelineStage
from minidist.trace.spans import now, sleep


class ProfiledStage(PipelineStage):
    """A PipelineStage that measures each layer's forward+backward seconds and activation bytes."""

    def __init__(self, model, bounds, stage: int, num_stages: int, slow=None, **kw):
        super().__init__(model, bounds, stage, num_stages, **kw)
        self.slow = slow
        self.step = 0
        self.reset()

    def reset(self) -> None:
        """Start a new step's measurements."""
        ids = [i for c in self.layer_ids for i in c]
        self.fwd = dict.fromkeys(ids, 0.0)
        self.bwd = dict.fromkeys(ids, 0.0)
        self.act_bytes = dict.fromkeys(ids, 0)
        self._bwd_start: dict[int, float] = {}
        self._fwd_once: dict[int, float] = {}

    def _emulated(self, real: float, rows: int, layer: int) -> float:
        """How long layer ``layer``'s forward lasts: its real time, stretched by the slowdown if any."""
        if self.slow is None:
            return real
        return self.slow.target(real, rows, self.slow.layer_factor(layer, self.step))

    def forward(self, x, chunk: int = 0):
        ids = self.layer_ids[chunk]
        if isinstance(x, Tensor) and x.requires_grad:
            x.register_hook(self._backward_ends(ids[0]))
        timed_end = isinstance(x, Tensor) and x.requires_grad
        for k, (i, layer) in enumerate(zip(ids, self.chunks[chunk])):
            t0 = now()
            y = layer(x)
            real = now() - t0
            target = self._emulated(real, x.shape[0], i)
            sleep(t0 + target - now())
            self.fwd[i] += target
            self._fwd_once[i] = (real, target)
            self.act_bytes[i] = max(self.act_bytes[i], int(y.data.nbytes))
            if y.requires_grad:
                y.register_hook(self._backward_starts(i, ids[k + 1] if k + 1 < len(ids) else None))
                if k == 0 and not timed_end:  # layer i's backward end is not observable: estimate it
                    self.bwd[i] += 2 * target
            x = y
        return x

    def _backward_starts(self, i: int, after: int | None):
        """Hook on y_i: layer ``after``'s backward (if any) ended, layer i's begins (slowed if skewed)."""
        def hook(grad):
            t = now()
            if after is not None and after in self._bwd_start:
                self.bwd[after] += t - self._bwd_start.pop(after)
            self._bwd_start[i] = t
            real, target = self._fwd_once.get(i, (0.0, 0.0))
            sleep(2 * (target - real))  # backward ~ 2x forward: twice the forward's emulated extra
        return hook

    def _backward_ends(self, i: int):
        """Hook on the stage's input: layer i, the first of the chunk, has finished its backward."""
        def hook(grad):
            if i in self._bwd_start:
                self.bwd[i] += now() - self._bwd_start.pop(i)
        return hook

    def layer_seconds(self) -> dict:
        return {i: self.fwd[i] + self.bwd[i] for i in self.fwd}
