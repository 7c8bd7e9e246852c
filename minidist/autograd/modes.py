"""The switches every op reads: is a graph being recorded, and where do saved arrays go.

``no_grad`` / ``enable_grad`` turn graph recording off and on; ``saved_tensors_hooks(pack, unpack)``
intercepts every array an op saves for backward (activation recomputation and offload use it, as
does the memory accountant). ``Context`` is what an op's forward leaves for its backward: it sends
each saved array through the innermost hook.

All switches are thread-local: the threads transport runs several ranks as threads of one process.
"""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def grad_enabled() -> bool:
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def _grad_mode(on: bool):
    prev = grad_enabled()
    _state.grad_enabled = on
    try:
        yield
    finally:
        _state.grad_enabled = prev


def no_grad():
    """Run without recording the graph (evaluation, optimizer steps, inference)."""
    return _grad_mode(False)


def enable_grad():
    """Record the graph again (inside a ``no_grad`` block)."""
    return _grad_mode(True)


def recomputing_depth() -> int:
    """How many activation recomputations run on this thread (0: an ordinary forward). A forward
    wrapper may keep what the backward right after needs (ZeRO-3 keeps its gathered unit)."""
    return getattr(_state, "recomputing", 0)


@contextlib.contextmanager
def recomputing():
    """Mark the body as a forward run again during backward (activation recomputation)."""
    _state.recomputing = recomputing_depth() + 1
    try:
        yield
    finally:
        _state.recomputing -= 1


def _hook_stack() -> list:
    stack = getattr(_state, "hooks", None)
    if stack is None:
        stack = _state.hooks = []
    return stack


@contextlib.contextmanager
def saved_tensors_hooks(pack, unpack):
    """Every array an op saves for backward goes through ``pack`` now and ``unpack`` in backward.

    ``pack(array) -> anything``; ``unpack(anything) -> array``. Nested hooks: the innermost wins.
    """
    stack = _hook_stack()
    stack.append((pack, unpack))
    try:
        yield
    finally:
        stack.pop()


def current_saved_tensors_hooks():
    """The innermost active ``(pack, unpack)`` pair, or None: a hook may hand arrays on to it."""
    stack = _hook_stack()
    return stack[-1] if stack else None


class Context:
    """What a Function's forward leaves for its backward: ``save(...)`` arrays, plain attributes."""

    __slots__ = ("_saved", "_unpack", "needs_grad", "record", "__dict__")

    def __init__(self, needs_grad, record=True):
        self.needs_grad = needs_grad  # per input: does it want a gradient?
        self.record = record  # will a backward ever read what is saved?
        self._saved = ()
        self._unpack = None

    def save(self, *arrays):
        if not self.record:  # no graph is being built: keep nothing, tell no hook
            return
        stack = getattr(_state, "hooks", None)
        if stack:
            pack, self._unpack = stack[-1]
            self._saved = tuple(None if a is None else pack(a) for a in arrays)
        else:
            self._saved = arrays

    @property
    def saved(self) -> tuple:
        if self._unpack is None:
            return self._saved
        return tuple(None if a is None else self._unpack(a) for a in self._saved)

    def release(self):
        self._saved = ()
        self.__dict__.clear()

