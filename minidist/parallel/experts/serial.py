"""The serial twin of an MoE GPT's run over a mesh: one process, every expert, the whole batch."""

from __future__ import annotations

from minidist.nn import GPT
from minidist.nn.optim import make_optimizer
from minidist.nn.serial import host_state, train_steps
from minidist.parallel.experts.model import moe_gpt


def train_serial_moe(cfg, batches, moe: dict, lr: float = 0.1, optimizer: str = "sgd"):
    """The serial twin of ``train_mesh(..., moe=moe)``: ``moe_gpt(GPT(cfg), **moe)`` trained by
    ``train_steps`` on the whole global batches. Returns (host state dict, losses)."""
    model = moe_gpt(GPT(cfg), **moe)
    losses = train_steps(model, batches, make_optimizer(optimizer, model.parameters(), lr))
    return host_state(model), losses
