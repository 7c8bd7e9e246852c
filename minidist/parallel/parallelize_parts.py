"""What ``parallelize`` builds from: the model, the optimizer, and the mixed-precision loss.

``build_model`` is the serial GPT, or for tp > 1 a ``TPGPT`` with the same initial weights, split;
``optimizer_factory`` turns an optimizer name into params -> optimizer (or AdamW with its state in
host memory); ``scaled_loss`` is the last pipeline stage's loss under mixed precision.
Re-exported by ``minidist.parallel.parallelize``.
"""

from __future__ import annotations

import numpy as np

from minidist.autograd import ops
from minidist.nn import GPT
from minidist.nn.optim import make_optimizer
from minidist.parallel.memory.offload import OffloadedAdamW
from minidist.parallel.tensor.gpt import TPGPT


def build_model(cfg, tp_comm=None, sequence_parallel: bool = False):
    """(model, loss_fn): the serial GPT, or for tp > 1 a TPGPT -- the same initial weights, split --
    with its vocabulary-parallel loss (None: ``ops.cross_entropy``)."""
    if tp_comm is None or tp_comm.size == 1:
        return GPT(cfg), None
    model = TPGPT(cfg, tp_comm, sequence_parallel=sequence_parallel)
    return model, model.loss_fn


def scaled_loss(loss_fn, mp):
    """The last stage's loss under mixed precision: of fp32 logits, times the loss scale (what
    ``mp.loss`` and ``mp.backward`` do outside a pipeline)."""
    return lambda logits, y: loss_fn(ops.cast(logits, np.float32), y) * mp.scale


def optimizer_factory(name, lr, offload):
    """params -> the optimizer: by name, or AdamW with its state in host memory (``offload``)."""
    if offload:  # AdamW's (check refuses another optimizer)
        return lambda ps: OffloadedAdamW(ps, None, lr=lr, weight_decay=0.0, where="host", prefetch=False)
    return lambda ps: make_optimizer(name, ps, lr)
