"""Tensor and the autograd graph.

A ``Tensor`` wraps one backend array (``.data``) and, if it was produced by a differentiable
operation while gradients were enabled, a ``Node`` that remembers the operation (a ``Function``
subclass from ``minidist.autograd.ops``), its context (what the forward saved) and its input tensors.

``loss.backward()`` walks that graph *iteratively* (no recursion limit on deep graphs). It counts,
for every tensor, how many consumers must send it a gradient; a tensor is processed only when all
of them have, so each gradient is complete before it is propagated. A leaf's gradient is
accumulated into ``leaf.grad`` (never in place: ``grad`` arrays are never mutated, only replaced)
and its post-accumulate hooks fire at once -- data parallelism launches its all-reduces from them
while the rest of the backward pass is still running.

Saved tensors go through ``Context.save``; ``saved_tensors_hooks(pack, unpack)`` intercepts them
(activation checkpointing and offload use it, as does the memory accountant).

All switches (``no_grad``, the saved-tensor hooks) are thread-local: the threads transport runs
several ranks as threads of one process.

``register_kernel_selector(fn)`` is the one hook by which an array library changes how an op runs:
``Function.apply`` calls ``fn(op_class)`` for inputs that are not NumPy arrays and runs the class it
returns (``minidist.accel.jax_engine.install`` registers ``kernel``: each op as one compiled call).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from minidist.accel import jax_engine
from minidist.accel.backend import Backend, backend_of, default_backend, get_backend

_state = threading.local()
_KERNEL = None  # the registered kernel selector: op class -> the class to run, for non-NumPy inputs


def register_kernel_selector(fn) -> None:
    """``fn(op_class) -> op_class`` runs every op whose first input is not a NumPy array; it may return
    the class itself (run as written) or a subclass (JAX: the op compiled). One selector at a time; None
    removes it. NumPy inputs never reach it: their hot path stays one type check."""
    global _KERNEL
    if fn is not None and not callable(fn):
        raise TypeError(f"register_kernel_selector: fn must be callable (op class -> op class) or None, "
                        f"got {type(fn).__name__}")
    _KERNEL = fn


def grad_enabled() -> bool:
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def no_grad():
    """Run without recording the graph (evaluation, optimizer steps, inference)."""
    prev = grad_enabled()
    _state.grad_enabled = False
    try:
        yield
    finally:
        _state.grad_enabled = prev


@contextlib.contextmanager
def enable_grad():
    prev = grad_enabled()
    _state.grad_enabled = True
    try:
        yield
    finally:
        _state.grad_enabled = prev


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


class Node:
    """One recorded operation: the Function, its context, and where each input's gradient goes.

    ``parents[i]`` is the Node that produced input i, the input itself if it is a leaf that wants a
    gradient, or None. The graph holds Nodes, not the tensors flowing between them, so an
    activation's memory is freed as soon as nothing but the graph refers to it -- unless an op
    saved it for backward (see ``Context.save``).
    """

    __slots__ = ("fn", "ctx", "parents", "shapes", "hooks")

    def __init__(self, fn, ctx, inputs):
        self.fn, self.ctx, self.hooks = fn, ctx, None
        self.parents = tuple(_parent(t) for t in inputs)
        self.shapes = tuple(t.shape if isinstance(t, Tensor) else None for t in inputs)


def _parent(t):
    if not (isinstance(t, Tensor) and t.requires_grad):
        return None
    return t if t._node is None else t._node


class Function:
    """A differentiable operation: ``forward(ctx, *arrays, **kw)`` and ``backward(ctx, grad)``.

    ``backward`` returns one gradient (array or None) per positional input, shaped like that input.
    Subclasses live in ``minidist.autograd.ops`` (their fast forms in ``minidist.autograd.fused``); call
    them through ``Function.apply``.
    """

    @staticmethod
    def forward(ctx, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def apply(cls, *inputs, **kwargs) -> Tensor:
        if _KERNEL is not None and type(getattr(inputs[0], "data", inputs[0])) is not np.ndarray:
            cls = _KERNEL(cls)  # JAX: the op as one compiled function (``register_kernel_selector``)
        if not getattr(_state, "grad_enabled", True):  # no graph (evaluation, decoding): the least work
            ctx = Context((False,) * len(inputs), record=False)
            return Tensor._result(cls.forward(ctx, *[t.data if isinstance(t, Tensor) else t for t in inputs],
                                              **kwargs))
        arrays = [t.data if isinstance(t, Tensor) else t for t in inputs]
        needs = tuple(isinstance(t, Tensor) and t.requires_grad for t in inputs)
        record = any(needs)  # gradients are enabled: the no-graph case returned above
        ctx = Context(needs, record)
        out = cls.forward(ctx, *arrays, **kwargs)
        result = Tensor(out, requires_grad=record)
        if record:
            result._node = Node(cls, ctx, inputs)
        else:
            ctx.release()
        return result


class Tensor:
    """An array with an optional gradient and the operation that produced it."""

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
        """An op's output without gradient: a NumPy array is taken as is (the common case, no
        checks); anything else (a scalar, another library's array) goes through ``__init__``."""
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

    # -- operators (implemented in minidist.autograd.ops) ----------------------------------------------
    def __add__(self, o):
        return _ops().add(self, o)

    def __radd__(self, o):
        return _ops().add(o, self)

    def __sub__(self, o):
        return _ops().sub(self, o)

    def __rsub__(self, o):
        return _ops().sub(o, self)

    def __mul__(self, o):
        return _ops().mul(self, o)

    def __rmul__(self, o):
        return _ops().mul(o, self)

    def __truediv__(self, o):
        return _ops().div(self, o)

    def __rtruediv__(self, o):
        return _ops().div(o, self)

    def __neg__(self):
        return _ops().neg(self)

    def __pow__(self, o):
        return _ops().pow(self, o)

    def __rpow__(self, o):
        return _ops().pow(o, self)

    def __matmul__(self, o):
        return _ops().matmul(self, o)

    def __rmatmul__(self, o):
        return _ops().matmul(o, self)

    def __getitem__(self, idx):
        return _ops().getitem(self, idx)

    def sum(self, axis=None, keepdims=False):
        return _ops().sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        return _ops().mean(self, axis, keepdims)

    def max(self, axis=None, keepdims=False):
        return _ops().max(self, axis, keepdims)

    def reshape(self, *shape):
        return _ops().reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list))
                              else shape)

    def transpose(self, *axes):
        return _ops().transpose(self, axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list))
                                else (axes or None))

    permute = transpose

    def exp(self):
        return _ops().exp(self)

    def log(self):
        return _ops().log(self)

    def tanh(self):
        return _ops().tanh(self)

    def relu(self):
        return _ops().relu(self)

    def astype(self, dtype):
        return _ops().cast(self, dtype)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, Tensor)


_OPS = None


def _ops():
    global _OPS
    if _OPS is None:
        from minidist.autograd import ops  # cycle: minidist.autograd.ops imports minidist.autograd.tensor

        _OPS = ops
    return _OPS


def tensor(data, dtype, requires_grad: bool = False, backend=None) -> Tensor:
    """Make a Tensor; the dtype is required (NumPy and JAX disagree on defaults)."""
    be = get_backend(backend) if backend is not None else default_backend()
    return Tensor(be.asarray(data, dtype=dtype), requires_grad=requires_grad, backend=be)


def _accumulate(a, b):
    if a is None:
        return b
    return a + b if type(a) is np.ndarray else _add(a, b)


@jax_engine.pure
def _add(a, b):
    """A gradient sum off NumPy: on JAX one stored program per shape, not an eager ``+``."""
    return a + b


def count_consumers(start) -> dict[int, int]:
    """id(node or leaf) -> how many graph edges point at it, below ``start`` (an iterative
    depth-first walk): a node runs its backward once all of them have delivered."""
    pending: dict[int, int] = {}
    stack = [start]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            continue
        if item.ctx is None:
            raise RuntimeError("backward through a graph a second time: its saved arrays were freed; "
                               "pass retain_graph=True to the first backward()")
        for parent in item.parents:
            if parent is not None:
                pending[id(parent)] = pending.get(id(parent), 0) + 1
                if pending[id(parent)] == 1:
                    stack.append(parent)
    return pending


def run_backward(root: Tensor, grad, retain_graph: bool = False) -> None:
    """Reverse-mode differentiation from ``root`` with seed gradient ``grad``.

    1. Count, by an iterative depth-first walk, how many graph edges point at each node or leaf.
    2. Process those whose consumers have all delivered their gradient (a stack: depth first, so
       a layer's parameters become ready as soon as that layer's backward has run).
    """
    start = root if root._node is None else root._node
    pending = count_consumers(start)
    grads = {id(start): grad}
    ready = [start]
    while ready:
        item = ready.pop()
        g = grads.pop(id(item), None)
        if g is None:  # every consumer returned None: nothing flows, but parents must hear so
            if not isinstance(item, Tensor):
                for parent in item.parents:
                    if parent is not None:
                        pending[id(parent)] -= 1
                        if pending[id(parent)] == 0:
                            ready.append(parent)
            continue
        if isinstance(item, Tensor):  # a leaf: run its hooks, accumulate, tell whoever waits for it
            for hook in item._hooks or ():
                out = hook(g)
                g = g if out is None else out
            item.grad = _accumulate(item.grad, g)
            for hook in item._post_hooks or ():
                hook(item)
            continue
        for hook in item.hooks or ():
            out = hook(g)
            g = g if out is None else out
        in_grads = item.fn.backward(item.ctx, g)
        if not isinstance(in_grads, tuple):
            in_grads = (in_grads,)
        for parent, shape, ig in zip(item.parents, item.shapes, in_grads):
            if parent is None:
                continue
            if ig is not None:
                if tuple(ig.shape) != shape:
                    raise RuntimeError(f"{item.fn.__name__}.backward returned a gradient of shape "
                                       f"{tuple(ig.shape)} for an input of shape {shape}")
                grads[id(parent)] = _accumulate(grads.get(id(parent)), ig)
            pending[id(parent)] -= 1
            if pending[id(parent)] == 0:
                ready.append(parent)
        if not retain_graph:
            item.ctx.release()
            item.ctx = None
