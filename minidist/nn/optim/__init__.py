"""Optimizers (AdamW, SGD), a warmup + cosine schedule, global-norm clipping; ``make_optimizer`` by name.

One file each: ``optimizer`` (the frame every optimizer shares), ``adamw``, ``sgd``, ``schedule``, ``clip``.
"""

from minidist.nn.optim.adamw import AdamW, adamw_arrays, adamw_update  # noqa: F401
from minidist.nn.optim.clip import clip_grad_norm, global_grad_norm  # noqa: F401
from minidist.nn.optim.optimizer import Optimizer, check_hyper  # noqa: F401
from minidist.nn.optim.schedule import WarmupCosine, warmup_cosine  # noqa: F401
from minidist.nn.optim.sgd import SGD  # noqa: F401


def make_optimizer(name: str, params, lr: float, **kw) -> Optimizer:
    """An optimizer by name, so a parallel run and its serial twin build the same one: "sgd", or
    "adamw" (weight decay 0 unless ``weight_decay=`` is given)."""
    if name == "sgd":
        return SGD(params, lr=lr, **kw)
    if name == "adamw":
        return AdamW(params, lr=lr, **{"weight_decay": 0.0, **kw})
    raise ValueError(f"unknown optimizer {name!r}: use 'sgd' or 'adamw'")
