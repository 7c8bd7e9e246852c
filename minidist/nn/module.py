"""Module and Parameter: a tree of layers that knows its parameters by name.

Parameters and sub-Modules are registered in assignment order, so ``named_parameters()`` has a
stable order (data parallelism buckets gradients in its reverse; checkpoints and pipeline stages
rely on the names). **The one way to wrap a forward**: a technique registers a forward wrapper at
its named position (``register_forward_wrapper``, one per position; ``handle.remove()`` takes it
away), never replaces ``forward``. ``module(x)`` runs them outermost first, each calling ``inner``,
the rest of the stack, when it chooses (lessons/01-train.md says why this order)::

    trace  >  recompute  >  offload  >  zero3  >  autocast  >  type(module).forward
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd.tensor import Tensor


class Parameter(Tensor):
    """A leaf tensor that a Module owns and an optimizer updates."""

    __slots__ = ()

    def __init__(self, data, requires_grad: bool = True, name: str | None = None):
        super().__init__(data, requires_grad=requires_grad, name=name)


#: Forward-wrapper positions, outermost first.
WRAPPER_ORDER = ("trace", "recompute", "offload", "zero3", "autocast")


class WrapperHandle:
    """What ``register_forward_wrapper`` returns: ``remove()`` takes that one wrapper away."""

    __slots__ = ("module", "position", "fn", "owner")

    def __init__(self, module, position, fn, owner):
        self.module, self.position, self.fn, self.owner = module, position, fn, owner

    def remove(self) -> None:
        """Unregister this wrapper (a no-op if it is already gone); other wrappers stay."""
        wrappers = self.module._wrappers
        if wrappers.get(self.position) is self:
            del wrappers[self.position]

    def __repr__(self):
        return f"<forward wrapper {self.position!r} of {self.owner} on {type(self.module).__name__}>"


class Module:
    """Base class: subclasses set Parameters and sub-Modules as attributes and define ``forward``."""

    def __init__(self):
        object.__setattr__(self, "_params", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_wrappers", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_params" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        if name == "forward":
            raise AttributeError(f"{type(self).__name__}.forward is not assigned on an instance; wrap it "
                                 "with module.register_forward_wrapper(fn, position) instead")
        self._params.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(value, Parameter):
            self._params[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args, **kwargs):
        if not self._wrappers:
            return self.forward(*args, **kwargs)
        return self._run_from(0, args, kwargs)

    def forward(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    # -- forward wrappers (the module docstring says which, and in what order) ------------------
    def register_forward_wrapper(self, fn, position: str, owner: str | None = None) -> WrapperHandle:
        """Wrap this module's forward at ``position`` (one of ``WRAPPER_ORDER``).

        ``fn(module, inner, *args, **kwargs)`` returns the output; ``inner(*args, **kwargs)`` runs the
        wrappers inside ``position`` and then the class forward. ``owner`` names the technique in
        errors. Returns a handle; ``handle.remove()`` unregisters this wrapper only."""
        if position not in WRAPPER_ORDER:
            raise ValueError(f"unknown forward-wrapper position {position!r}; use one of {WRAPPER_ORDER}")
        owner = owner or position
        taken = self._wrappers.get(position)
        if taken is not None:
            raise ValueError(f"{type(self).__name__} already has a {position!r} forward wrapper (from "
                             f"{taken.owner}); {owner} cannot add a second one: remove the first "
                             "(its handle's remove()) or apply the technique once")
        handle = WrapperHandle(self, position, fn, owner)
        self._wrappers[position] = handle
        return handle

    def forward_wrapper(self, position: str) -> WrapperHandle | None:
        """The handle of the wrapper registered at ``position``, or None."""
        return self._wrappers.get(position)

    def forward_wrappers(self) -> list[WrapperHandle]:
        """The registered wrappers, outermost first (the order a call runs them)."""
        return [self._wrappers[p] for p in WRAPPER_ORDER if p in self._wrappers]

    def call_inside(self, position: str, *args, **kwargs):
        """Run only the wrappers *inside* ``position``, then the class forward: what a wrapper that
        re-runs the layer (a recomputed segment) calls for its members."""
        return self._run_from(WRAPPER_ORDER.index(position) + 1, args, kwargs)

    def _run_from(self, level: int, args, kwargs):
        for lv in range(level, len(WRAPPER_ORDER)):
            handle = self._wrappers.get(WRAPPER_ORDER[lv])
            if handle is not None:
                def inner(*a, _next=lv + 1, **kw):
                    return self._run_from(_next, a, kw)
                return handle.fn(self, inner, *args, **kwargs)
        return self.forward(*args, **kwargs)

    # -- the tree --------------------------------------------------------------------------------
    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for name, mod in self._modules.items():
            yield from mod.named_modules(f"{prefix}{name}.")

    def children(self):
        return list(self._modules.values())

    def named_parameters(self, prefix: str = ""):
        seen = set()
        for mprefix, mod in self.named_modules(prefix):
            for name, p in mod._params.items():
                if id(p) not in seen:  # a shared (tied) parameter is listed once, first name wins
                    seen.add(id(p))
                    yield f"{mprefix}{name}", p

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def train(self, mode: bool = True):
        for _, mod in self.named_modules():
            object.__setattr__(mod, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Name -> array (the live arrays; copy them if you will modify the model afterwards)."""
        return OrderedDict((name, p.data) for name, p in self.named_parameters())

    def load_state_dict(self, state: dict, strict: bool = True):
        """Copy arrays into the parameters; names and shapes must match (all names if strict)."""
        params = dict(self.named_parameters())
        missing = [n for n in params if n not in state]
        unexpected = [n for n in state if n not in params]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, arr in state.items():
            if name not in params:
                continue
            p = params[name]
            if tuple(arr.shape) != p.shape:
                raise ValueError(f"load_state_dict: {name} has shape {tuple(arr.shape)}, "
                                 f"the model expects {p.shape}")
            host = np.array(backend_of(arr).to_host(arr), dtype=p.dtype)  # a copy: never alias
            p.data = p.backend.from_host(host)
        return self


class ModuleList(Module):
    """A list of modules, registered as ``0``, ``1``, ... ."""

    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module):
        setattr(self, str(len(self._modules)), module)

    def __getitem__(self, i):
        return list(self._modules.values())[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class Sequential(ModuleList):
    """Modules applied one after another: the shape a pipeline splits into stages."""

    def forward(self, x):
        for m in self:
            x = m(x)
        return x
