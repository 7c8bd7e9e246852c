"""The optimizer's frame: parameters, per-parameter state, one step, and the state to save.

An ``Optimizer`` reads ``p.grad`` and writes ``p.data``: in place on NumPy and CuPy, new arrays on JAX
(immutable). A subclass says how one parameter is updated (``update``) and, for a compiling engine,
all at once (``update_all``). ``state_dict`` holds host copies: restorable exactly, on any backend.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel import compiled
from minidist.accel.backend import backend_of


class Optimizer:
    def __init__(self, params, lr: float):
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.lr = check_hyper(type(self).__name__, "lr", lr, low=0.0)
        self.step_count = 0
        self.state: list[dict] = [{} for _ in self.params]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        self.step_count += 1
        self.apply_updates([(p, st) for p, st in zip(self.params, self.state)
                    if p.grad is not None and p.requires_grad])

    def apply_updates(self, live):
        """This step's update of the (parameter, state) pairs ``live``: on JAX one compiled call
        (``update_all``), elsewhere one parameter at a time (``update``)."""
        if live and compiled.compiles(live[0][0].data):
            self.update_all(live)  # JAX: the whole update as one compiled call
        else:
            for p, st in live:
                self.update(p, st)

    def update(self, p, state):  # pragma: no cover - abstract
        raise NotImplementedError

    def update_all(self, live):
        """Update every (parameter, state) pair of ``live`` at once; by default one by one."""
        for p, st in live:
            self.update(p, st)

    def state_dict(self) -> dict:
        return {"lr": self.lr, "step_count": self.step_count,
                "state": [{k: np.array(backend_of(v).to_host(v)) for k, v in st.items()}
                          for st in self.state]}

    def load_state_dict(self, sd: dict):
        if len(sd["state"]) != len(self.params):
            raise ValueError(f"optimizer state has {len(sd['state'])} entries, this optimizer has "
                             f"{len(self.params)} parameters")
        self.lr, self.step_count = sd["lr"], sd["step_count"]
        self.state = [{k: p.backend.from_host(np.array(v)) for k, v in st.items()}
                      for p, st in zip(self.params, sd["state"])]
        return self


def check_hyper(owner: str, name: str, value, low: float, high: float | None = None,
                open_low: bool = False) -> float:
    """``value`` as a float, or a ValueError naming ``owner``'s argument ``name`` and the allowed
    range: finite, >= ``low`` (> with ``open_low``), < ``high`` if given. NaN and inf never pass."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    value = float(value)
    below = value <= low if open_low else value < low
    if not math.isfinite(value) or below or (high is not None and value >= high):
        allowed = ("(" if open_low else "[") + f"{low:g}, " + (f"{high:g})" if high is not None else "inf)")
        raise ValueError(f"{owner}: {name} must be a finite number in {allowed}, got {value}")
    return value
