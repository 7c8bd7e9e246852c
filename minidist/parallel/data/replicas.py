"""Start-up of data parallelism: every rank must hold the same model, with the same values.

``check_same_model`` compares what each rank built (an error on every rank naming the ranks that
differ, not a hang in the first gradient collective); ``broadcast_parameters`` copies rank 0's values
to all (ranks may have been seeded differently). DDP, ZeRO and local SGD run both at construction.
"""

from __future__ import annotations

from minidist.comm import broadcast
from minidist.parallel.data.buckets import build_buckets


def model_signature(module) -> list[tuple]:
    return [(name, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
            for name, p in module.named_parameters()]


def check_same_model(comm, module) -> None:
    """Every rank must wrap the same architecture: a ValueError on *every* rank naming the ranks whose
    (name, shape, dtype, requires_grad) lists differ, before a gradient collective could hang."""
    sigs = comm.allgather_obj(model_signature(module))
    bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
    if not bad:
        return
    r = bad[0]
    a, b = sigs[0], sigs[r]
    diff = next((f"rank 0 has {x}, rank {r} has {y}" for x, y in zip(a, b) if x != y),
                f"rank 0 has {len(a)} parameters, rank {r} has {len(b)}")
    raise ValueError(f"rank {comm.rank}: data-parallel ranks disagree on the model (ranks {bad} differ "
                     f"from rank 0): first difference: {diff}. Build the same model on every rank.")


def broadcast_parameters(comm, module, root: int = 0) -> None:
    """Make every rank's parameters (frozen ones too) equal to ``root``'s: one broadcast per dtype."""
    for b in build_buckets(module.parameters(), float("inf")):
        flat = broadcast(comm, b.flatten([p.data for p in b.params]), root=root)
        for p, v in zip(b.params, b.views(flat)):
            p.data = v


