"""A mixture-of-experts MLP block: a router sends each token to k of E expert MLPs (GShard, Switch).

For N tokens x (N, d) and E experts: (1) **route** -- probs = softmax(x·W_r), each token's top-k
experts, its gates their probs (top-2: renormalised); (2) **capacity** -- each expert takes at most
C = ceil(capacity_factor · k · N / E) tokens, first choices first, the rest **dropped** (a token
dropped by every expert passes through the residual); (3) **dispatch** -- kept tokens into a buffer
of E x C rows (expert e's slot s at row e·C + s): a fixed shape, which expert parallelism exchanges
by all-to-all; (4) **experts** -- expert e on its C rows (``run_experts``: what EP replaces); (5)
**combine** -- each kept assignment's output row, times its gate, added to its token. Steps 3-5 and
the auxiliary losses (on ``moe.stats``) are one op each (``moe_steps.py``); on JAX the assignments
are padded to one shape (``pad_assignments``, chapter 15).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minidist.accel.backend import backend_of, compiles_per_shape, to_host
from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.nn.layers import MLP, Dropout, Linear
from minidist.nn.module import Module, ModuleList
from minidist.nn.moe_steps import (
    Combine,
    Dispatch,
    ExpertMLPs,
    LoadBalancingLoss,
    RouterZLoss,
    expert_rows,
    join_rows,
)

# -- routing decisions (arrays: no gradient flows through a choice) -------------------------------

def capacity(n_tokens: int, n_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(capacity_factor · k · N / E), at least 1."""
    return max(1, math.ceil(capacity_factor * k * n_tokens / n_experts))


def top_k_route(probs: np.ndarray, k: int, cap: int):
    """Top-k routing with capacity on (N, E) router probabilities: ``(experts, slots)``, both (N, k):
    token n's j-th choice (descending probability, ties to the lower expert) and its slot in that
    expert's buffer, or -1 where dropped; first choices get slots first, in token order."""
    n, e = probs.shape
    if not 1 <= k <= e:
        raise ValueError(f"top-k routing needs 1 <= k <= n_experts={e}, got k={k}")
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    slots = np.full((n, k), -1, dtype=np.int64)
    filled = np.zeros(e, dtype=np.int64)
    for j in range(k):
        for t in range(n):
            x = experts[t, j]
            if filled[x] < cap:
                slots[t, j] = filled[x]
                filled[x] += 1
    return experts, slots


def pad_assignments(tok, choice, rows, total: int, dtype):
    """The kept assignments (token, choice, buffer row) padded to ``total`` (all N·k), and ``keep``
    (total, 1): 1 for a real one, 0 for padding (token 0 to row 0, times 0: exact zeros)."""
    pad = np.zeros(total - len(tok), dtype=np.int64)
    keep = (np.arange(total) < len(tok)).astype(dtype)[:, None]
    return np.concatenate([tok, pad]), np.concatenate([choice, pad]), np.concatenate([rows, pad]), keep


def routed_fraction(experts: np.ndarray, n_experts: int) -> np.ndarray:
    """f_e: the fraction of all N·k choices in ``experts`` (N, k) that name expert e (before drops)."""
    return np.bincount(experts.ravel(), minlength=n_experts) / experts.size


@dataclass
class MoEStats:
    """What one forward routed (tokens and kept per expert, dropped fraction, capacity) and the two
    auxiliary losses (Tensors to add to the loss; under activation recompute without gradient)."""
    tokens_per_expert: np.ndarray
    kept_per_expert: np.ndarray
    dropped_fraction: float
    capacity: int
    aux_loss: Tensor
    z_loss: Tensor

    @property
    def imbalance_cv(self) -> float:
        """Coefficient of variation of tokens per expert: std / mean (0 = perfectly balanced)."""
        t = self.tokens_per_expert.astype(np.float64)
        return float(t.std() / t.mean()) if t.mean() > 0 else 0.0


# -- the block ------------------------------------------------------------------------------------

class MoE(Module):
    """``MoE(dim, n_experts, k, capacity_factor)``: x (..., d) -> (..., d), the experts' gated sum;
    in place of a block's MLP: x + moe(ln(x)) (dropped tokens keep x)."""

    def __init__(self, dim, n_experts, k=1, capacity_factor=1.25, hidden=None, *, dtype=np.float32,
                 std=0.02, proj_std=None, rng=None, backend=None):
        super().__init__()
        if not (isinstance(n_experts, int) and n_experts >= 1 and isinstance(k, int) and 1 <= k <= n_experts):
            raise ValueError(f"MoE needs n_experts >= 1 and 1 <= k <= n_experts, got "
                             f"n_experts={n_experts!r}, k={k!r}")
        if not capacity_factor > 0:
            raise ValueError(f"MoE capacity_factor must be > 0, got {capacity_factor!r}")
        self.n_experts, self.k, self.capacity_factor = n_experts, k, capacity_factor
        self.router = Linear(dim, n_experts, bias=False, dtype=dtype, std=std, rng=rng, backend=backend)
        self.experts = ModuleList([MLP(dim, hidden, dtype=dtype, std=std, proj_std=proj_std, rng=rng,
                                       backend=backend) for _ in range(n_experts)])
        self.stats = None

    def forward(self, x):
        shape = x.shape
        xf = x if len(shape) == 2 else x.reshape(-1, shape[-1])            # tokens as rows (N, d)
        n, e, k = xf.shape[0], self.n_experts, self.k
        logits, probs, experts, slots, cap = self.route(xf)
        tok, choice = np.nonzero(slots >= 0)                               # the kept assignments
        rows = experts[tok, choice] * cap + slots[tok, choice]             # their buffer rows
        keep = None
        if compiles_per_shape(backend_of(probs.data)):                     # one shape: N·k, padded
            tok, choice, rows, keep = pad_assignments(tok, choice, rows, n * k, probs.dtype)
        buf = Dispatch.apply(xf, tok, rows, keep, e * cap)                 # dispatch: (E·C, d)
        out_buf = self.run_experts(buf, cap)
        out = Combine.apply(out_buf, probs, experts, tok, choice, rows, keep)  # gates, gated sum
        self.stats = self._stats(logits, probs, experts, slots, cap)
        return out if len(shape) == 2 else out.reshape(*shape)

    def route(self, xf):
        """Steps 1 and 2 for tokens xf (N, d): (logits, probs) Tensors, and on the host each token's
        (experts, slots) (``top_k_route``) at C = ``capacity(...)`` slots; returns the five."""
        logits = self.router(xf)
        probs = ops.softmax(logits, axis=-1)
        cap = capacity(xf.shape[0], self.n_experts, self.k, self.capacity_factor)
        experts, slots = top_k_route(to_host(probs.data), self.k, cap)
        return logits, probs, experts, slots, cap

    def run_experts(self, buf, cap):
        """Expert e on rows e·C .. (e+1)·C - 1 of the dispatch buffer; the outputs in the same rows."""
        return run_local_experts(self.experts, buf, 1, cap)

    def _stats(self, logits, probs, experts, slots, cap) -> MoEStats:
        e = self.n_experts
        routed = np.bincount(experts.ravel(), minlength=e)
        kept = np.bincount(experts[slots >= 0], minlength=e)
        f = (routed / experts.size).astype(probs.data.dtype)  # routed_fraction, on the host: no gradient
        aux, z = LoadBalancingLoss.apply(probs, f, e), RouterZLoss.apply(logits)
        return MoEStats(routed, kept, float(1 - kept.sum() / experts.size), cap, aux, z)


def _batchable(experts) -> bool:
    """Can ``ExpertMLPs`` run these experts as one op? Plain MLPs with no dropout at work, no forward
    wrapper on any of their modules (a technique acting around an expert must see it called), and
    no 2-byte float weights (``ops.linear`` computes those in float32: the module path does)."""
    for ex in experts:
        if type(ex) is not MLP or not (type(ex.fc) is type(ex.proj) is Linear and type(ex.drop) is Dropout):
            return False  # (a module swapped into an MLP would be skipped, not run)
        if ex.fc.bias is None or ex.proj.bias is None:
            return False
        # (its modules and parameters are these four and these four: no tree walk on every forward)
        if ex.drop.p and ex.drop.training or any(m.forward_wrappers() for m in (ex, ex.fc, ex.proj, ex.drop)):
            return False
        if any(ops.low_precision(t.dtype) for t in (ex.fc.weight, ex.fc.bias, ex.proj.weight, ex.proj.bias)):
            return False
    return True


def run_local_experts(experts, x, groups: int, cap: int):
    """Expert i of ``experts`` on its C rows of each of the ``groups`` blocks of x (groups·E·C, d),
    outputs in the same rows: one op (``ExpertMLPs``) where the experts allow it, else each module."""
    if _batchable(experts):
        params = [t for ex in experts for t in (ex.fc.weight, ex.fc.bias, ex.proj.weight, ex.proj.bias)]
        return ExpertMLPs.apply(x, *params, groups=groups, cap=cap)
    n = len(experts)
    outs = [ex(expert_rows(x, groups, n, i, cap)) for i, ex in enumerate(experts)]
    return join_rows(outs, groups, cap, x.shape, ops.concat)
