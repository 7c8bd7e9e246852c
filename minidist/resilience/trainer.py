"""The training loop a restart resumes: a job handed in by its builder, one batch a step.

Resilience knows nothing of the techniques inside a job. The caller (the fault-tolerance lesson with
``parallelize``, a benchmark, a test) builds it and hands over three things:

* ``train_step(x, y) -> loss``: one training step on a global batch, collective;
* ``state``: a ``TrainState`` of its arrays (parameters, optimizer state, RNG streams) -- what to save;
* ``loader``: the data position (``next_batch()``, ``state_dict``/``load_state_dict``), and optionally
  a ``schedule`` (the learning rate's) stepped after each step.

``Trainer.step()`` takes the next batch, trains on it and counts it; ``Trainer.state()`` is the handed
state plus the loader, the schedule and the step count: everything ``checkpoint.save`` needs to resume
the job exactly, and what ``checkpoint.load`` restores it from.
"""

from __future__ import annotations

import dataclasses


class Trainer:
    """One rank's loop over a handed job (see the module docstring)."""

    def __init__(self, train_step, state, loader, schedule=None):
        self.train_step, self.loader, self.schedule = train_step, loader, schedule
        self._state = state
        self.step_count, self.losses = 0, []

    def step(self) -> float:
        """Train one step on the next global batch; returns what ``train_step`` returned, as a float."""
        x, y = self.loader.next_batch()
        loss = float(self.train_step(x, y))
        if self.schedule is not None:
            self.schedule.step()
        self.step_count += 1
        self.losses.append(loss)
        return loss

    def state(self):
        """The handed ``TrainState`` with the loop's own objects added: loader, schedule, step count."""
        mine = {"loader": self.loader, "trainer": self}
        if self.schedule is not None:
            mine["schedule"] = self.schedule
        return dataclasses.replace(self._state, objects={**self._state.objects, **mine})

    def state_dict(self) -> dict:  # the step count: an object of the checkpoint, like the loader
        return {"step": self.step_count}

    def load_state_dict(self, sd: dict):
        self.step_count = sd["step"]
