"""Tensor: an array, its gradient, and the operation that produced it.

A ``Tensor`` wraps one backend array (``.data``) and, when a differentiable op made it while
gradients were on, the graph ``Node`` (``graph.py``) that remembers the op, what its forward saved
(``Context``, ``modes.py``) and its inputs. ``Function.apply`` is where an op meets the graph;
``loss.backward()`` hands the seed to ``graph.run_backward``. The ops, and Tensor's operators and
methods (``+``, ``@``, ``.sum()``), are in ``minidist.autograd.ops``, which attaches them to this
class. Off NumPy, ``Function.apply`` runs the class an engine's ``kernel`` returns (the seam
``minidist.accel.compiled``; JAX: each op one compiled call).
"""

from __future__ import annotations

import numpy as np

from minidist.accel import compiled
from minidist.accel.backend import Backend, backend_of, default_backend, get_backend
from minidist.autograd import meter
from minidist.autograd.graph import Node, _accumulate, _add, count_consumers, run_backward  # noqa: F401
from minidist.autograd.modes import (  # noqa: F401
    Context,
    _state,
    current_saved_tensors_hooks,
    enable_grad,
    grad_enabled,
    no_grad,
    saved_tensors_hooks,
)


def _parent(t):
    if not (isinstance(t, Tensor) and t.requires_grad):
        return None
    return t if t._node is None else t._node


class Function:
    """A differentiable operation: ``forward(ctx, *arrays, **kw)`` and ``backward(ctx, grad)``.

    ``backward`` returns one gradient (array or None) per positional input, shaped like that input.
    Subclasses live in ``minidist.autograd.ops``; call them through ``Function.apply``.
    """

    @staticmethod
    def forward(ctx, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def apply(cls, *inputs, **kwargs) -> Tensor:
        if compiled.ENGINE is not None and type(getattr(inputs[0], "data", inputs[0])) is not np.ndarray:
            cls = compiled.ENGINE.kernel(cls)  # JAX: the op as one compiled function (the seam)
        if not getattr(_state, "grad_enabled", True):  # no graph (evaluation, decoding): the least work
            ctx = Context((False,) * len(inputs), record=False)
            arrays = [t.data if isinstance(t, Tensor) else t for t in inputs]
            out = cls.forward(ctx, *arrays, **kwargs)
            if meter.METER is not None:
                meter.METER(cls, arrays, out, False)
            return Tensor._result(out)
        arrays = [t.data if isinstance(t, Tensor) else t for t in inputs]
        needs = tuple(isinstance(t, Tensor) and t.requires_grad for t in inputs)
        record = any(needs)  # gradients are enabled: the no-graph case returned above
        ctx = Context(needs, record)
        out = cls.forward(ctx, *arrays, **kwargs)
        if meter.METER is not None:
            meter.METER(cls, arrays, out, False)
        result = Tensor(out, requires_grad=record)
        if record:
            result._node = Node(cls, ctx, tuple(_parent(t) for t in inputs),
                                tuple(t.shape if isinstance(t, Tensor) else None for t in inputs))
        else:
            ctx.release()
        return result


class Tensor:
    """An array with an optional gradient and the operation that produced it (its operators and
    array methods are attached by ``minidist.autograd.ops``)."""

    __slots__ = ("data", "grad", "requires_grad", "_node", "_hooks", "_post_hooks", "name",
                 "__weakref__")
    __array_priority__ = 1000  # numpy scalars defer to our operators

    def __init__(self, data, requires_grad: bool = False, dtype=None, backend: Backend | None = None,
                 name: str | None = None):
        if isinstance(data, Tensor):
            data = data.data
        be = backend or (backend_of(data) if _is_array(data) else default_backend())
        if not be.is_array(data) or (dtype is not None and data.dtype != dtype):
            data = be.asarray(data, dtype=dtype)
        self.data = data
        self.grad = None
        self.requires_grad = requires_grad
        self._node = None
        self._hooks = None
        self._post_hooks = None
        self.name = name

    @classmethod
    def _result(cls, data) -> Tensor:
        """An op's output without gradient: a NumPy array as is, anything else through ``__init__``."""
        if type(data) is not np.ndarray:
            return cls(data)
        t = object.__new__(cls)
        t.data, t.grad, t.requires_grad, t._node, t._hooks, t._post_hooks, t.name = \
            data, None, False, None, None, None, None
        return t

    # -- properties ----------------------------------------------------------------------------
    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: int(self.data.size))
    backend = property(lambda self: backend_of(self.data))
    is_leaf = property(lambda self: self._node is None)
    T = property(lambda self: self.transpose())

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}{grad})"

    def numpy(self):
        """The data as a NumPy array (copied to the host if needed)."""
        return self.backend.to_host(self.data)

    def item(self) -> float:
        return self.numpy().item()

    def detach(self) -> Tensor:
        return Tensor(self.data)

    def zero_grad(self):
        self.grad = None

    # -- hooks ---------------------------------------------------------------------------------
    def register_hook(self, fn):
        """``fn(grad) -> grad | None`` runs when this tensor's gradient is complete, before it is
        used; returning an array replaces the gradient."""
        if self._node is None:
            self._hooks = (self._hooks or []) + [fn]
        else:
            self._node.hooks = (self._node.hooks or []) + [fn]
        return fn

    def register_post_accumulate_grad_hook(self, fn):
        """``fn(tensor)`` runs right after a leaf's ``.grad`` has been updated in backward."""
        if not self.is_leaf:
            raise RuntimeError("post-accumulate-grad hooks are for leaf tensors (parameters) only")
        self._post_hooks = (self._post_hooks or []) + [fn]
        return fn

    # -- backward ------------------------------------------------------------------------------
    def backward(self, grad=None, retain_graph: bool = False):
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad`` that requires a gradient."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad "
                               "(was it computed under no_grad(), or from inputs without requires_grad?)")
        if grad is None:
            if self.size != 1:
                raise RuntimeError(f"backward() on a non-scalar tensor of shape {self.shape} needs an "
                                   "explicit gradient of that shape: t.backward(grad)")
            grad = np.ones(self.data.shape, dtype=self.dtype)  # one element, moved over just below
        elif isinstance(grad, Tensor):
            grad = grad.data
        if not self.backend.is_array(grad):  # host seed to device (JAX: no program; CuPy)
            grad = self.backend.asarray(grad)
        if tuple(grad.shape) != self.shape:
            raise ValueError(f"backward(): gradient shape {tuple(grad.shape)} != tensor shape {self.shape}")
        if grad.dtype != self.dtype:
            raise TypeError(f"backward(): gradient dtype {grad.dtype} != tensor dtype {self.dtype}; "
                            f"cast it first (dtypes never change silently)")
        run_backward(self, grad, retain_graph)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, Tensor)


def tensor(data, dtype, requires_grad: bool = False, backend=None) -> Tensor:
    """Make a Tensor; the dtype is required (NumPy and JAX disagree on defaults)."""
    be = get_backend(backend) if backend is not None else default_backend()
    return Tensor(be.asarray(data, dtype=dtype), requires_grad=requires_grad, backend=be)
