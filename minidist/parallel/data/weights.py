"""How much each microbatch's loss weighs, so that data parallelism's average is the serial mean.

The serial loss is the mean over the global batch's N valid tokens (targets of -1 don't count). A
replica's microbatch holding n_mb of them weighs n_mb / N, not 1/m; DDP then divides the summed
gradients by its dp ranks, so the weight is dp * n_mb / N and the sum over every replica and
microbatch is the serial mean (with context parallelism dp * cp, over each rank's own tokens).
"""

from __future__ import annotations

import numpy as np


def token_loss_weights(ys, n_total: int, dp: int, ignore_index: int = -1) -> list[float]:
    """Per-microbatch loss weights dp * n_mb / N: ``ys`` are this replica's microbatch targets,
    ``n_total`` the global batch's valid-token count N (0 gives zero weights, as the serial mean
    over no tokens is 0 with no gradient)."""
    n_total = max(int(n_total), 1)
    return [dp * int((np.asarray(y) != ignore_index).sum()) / n_total for y in ys]
