"""The compiled SPMD program: minidist's dp x tp GPT training step written once in pure JAX.

What minidist does eagerly, rank by rank, message by message, is written here as one program for
one device: ``shard_map`` runs it on every device of a ``Mesh(('dp', 'tp'))`` (mesh.py), and
``jax.jit`` compiles the whole step -- forward, backward, gradient all-reduce, SGD update -- into
one executable whose collectives are instructions of the interconnect.

* **Tensor parallel (Megatron).** Heads and MLP hidden units split over ``tp``; Megatron's ``f``
  (identity forward, all-reduce backward) and ``g`` (all-reduce forward, identity backward) mark
  the region, as ``copy_to_tp`` / ``reduce_from_tp`` do in ``minidist.parallel.tensor.comm``.
* **Data parallel.** Each ``dp`` row takes its slice of the batch, and the gradients are summed over
  ``dp`` with chapter 2's ring all-reduce written with ppermute (``ring_all_reduce``), or ``psum``.

Parameters keep minidist's names and shapes outside the step (inside, the QKV weight is viewed as
(C, 3, H, D) so the heads split along one axis); ``collective_counts`` counts the collectives XLA
emitted. Why, and what XLA emitted beside what minidist sends: chapter 16 (lessons/16-tpu.md).
"""

from __future__ import annotations

import math
import re
from functools import partial

import numpy as np

from minidist.nn import GPT
from minidist.nn.serial import host_state
from minidist.parallel.spmd.mesh import _jax, global_array, make_mesh


# -- Megatron's f and g ------------------------------------------------------------------------
def _tp_ops():
    jax = _jax()

    @jax.custom_vjp
    def f(x):  # copy to the tp region: identity forward, all-reduce of the gradient backward
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (jax.lax.psum(g, "tp"),))

    @jax.custom_vjp
    def g(x):  # reduce from the tp region: all-reduce forward, identity backward
        return jax.lax.psum(x, "tp")

    g.defvjp(lambda x: (jax.lax.psum(x, "tp"), None), lambda _, d: (d,))
    return f, g


def ring_all_reduce(x, axis: str, p: int):
    """Chapter 2's ring all-reduce inside ``shard_map``: ``x`` split into p chunks; p-1 steps of
    reduce-scatter (send chunk r-s to the right, add what comes from the left), then p-1 steps of
    all-gather (pass the finished chunks on). Each step is one ``ppermute`` (collective-permute)."""
    jax = _jax()
    jnp = jax.numpy
    if p == 1:
        return x
    n = x.size
    flat = jnp.pad(x.reshape(-1), (0, (-n) % p))
    chunks = flat.reshape(p, -1)
    r = jax.lax.axis_index(axis)
    right = [(i, (i + 1) % p) for i in range(p)]
    for s in range(p - 1):  # reduce-scatter: rank r ends owning the sum of chunk (r + 1) % p
        got = jax.lax.ppermute(chunks[(r - s) % p], axis, right)
        chunks = chunks.at[(r - s - 1) % p].add(got)
    for s in range(p - 1):  # all-gather
        got = jax.lax.ppermute(chunks[(r + 1 - s) % p], axis, right)
        chunks = chunks.at[(r - s) % p].set(got)
    return chunks.reshape(-1)[:n].reshape(x.shape)


# -- the model, for one device ------------------------------------------------------------------
def _layer_norm(jnp, x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * w + b


def _gelu(jnp, x):  # the tanh approximation, as minidist.autograd.ops.Gelu
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def local_loss(params, x, y, n_valid, n_layer: int):
    """This device's share of the loss: sum of its tokens' cross-entropies / N (global valid count)."""
    jax = _jax()
    jnp = jax.numpy
    f, g = _tp_ops()
    t = x.shape[1]
    h = params["0.wte.weight"][x] + params["0.wpe.weight"][:t]
    for i in range(1, n_layer + 1):
        p = {k[len(f"{i}."):]: v for k, v in params.items() if k.startswith(f"{i}.")}
        a = f(_layer_norm(jnp, h, p["ln1.weight"], p["ln1.bias"]))
        qkv = jnp.einsum("btc,cjhd->jbhtd", a, p["attn.qkv.weight"]) + p["attn.qkv.bias"][:, None, :, None]
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B, H/tp, T, D): this device's heads
        s = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        o = jnp.einsum("bhtd,hdc->btc", jax.nn.softmax(s, -1) @ v, p["attn.proj.weight"])
        h = h + g(o) + p["attn.proj.bias"]
        m = f(_layer_norm(jnp, h, p["ln2.weight"], p["ln2.bias"]))
        u = _gelu(jnp, m @ p["mlp.fc.weight"] + p["mlp.fc.bias"])
        h = h + g(u @ p["mlp.proj.weight"]) + p["mlp.proj.bias"]
    last = n_layer + 1
    logits = _layer_norm(jnp, h, params[f"{last}.ln.weight"], params[f"{last}.ln.bias"]) @ \
        params[f"{last}.proj.weight"]
    logp = jax.nn.log_softmax(logits, -1)
    valid = y != -1
    nll = -jnp.take_along_axis(logp, jnp.where(valid, y, 0)[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(valid, nll, 0.0)) / n_valid


# -- layouts: minidist's names and shapes <-> the SPMD program's sharded views ---------------
def _view(name: str, a, n_head: int):
    """minidist's array -> the SPMD program's view (heads on their own axis where they are split)."""
    c = a.shape[0]
    if name.endswith("attn.qkv.weight"):
        return a.reshape(c, 3, n_head, -1)
    if name.endswith("attn.qkv.bias"):
        return a.reshape(3, n_head, -1)
    if name.endswith("attn.proj.weight"):
        return a.reshape(n_head, -1, a.shape[1])
    return a


def _spec(name: str):
    from jax.sharding import PartitionSpec as P

    for suffix, spec in (("attn.qkv.weight", P(None, None, "tp", None)),
                         ("attn.qkv.bias", P(None, "tp", None)), ("attn.proj.weight", P("tp", None, None)),
                         ("mlp.fc.weight", P(None, "tp")), ("mlp.fc.bias", P("tp")),
                         ("mlp.proj.weight", P("tp", None))):
        if name.endswith(suffix):
            return spec
    return P()  # replicated: embeddings, layer norms, output biases, the head


class SPMDProgram:
    """``SPMDProgram(cfg, dp, tp)``: GPT(cfg)'s initial weights placed on a dp x tp mesh, and
    ``step(x, y)`` -> loss, one jitted SGD step. ``dp_reduce``: "ring" (ppermute) or "psum"."""

    def __init__(self, cfg, dp: int, tp: int, lr: float = 0.1, dp_reduce: str = "ring", devices=None):
        jax = _jax()
        if cfg.dropout:
            raise ValueError(f"the SPMD program has no dropout (got dropout={cfg.dropout})")
        if cfg.kv_heads != cfg.n_head:
            raise ValueError(f"the compiled SPMD program has multi-head attention only (n_kv_head="
                             f"{cfg.kv_heads} < n_head={cfg.n_head}); use n_kv_head=n_head")
        if cfg.n_head % tp:
            raise ValueError(f"n_head={cfg.n_head} is not divisible by tp={tp}")
        if dp_reduce not in ("ring", "psum"):
            raise ValueError(f"dp_reduce={dp_reduce!r}: use 'ring' or 'psum'")
        self.cfg, self.dp, self.tp, self.lr = cfg, dp, tp, lr
        self.mesh = make_mesh(dp, tp, devices)
        state = host_state(GPT(cfg, backend="numpy"))
        self.shapes = {k: v.shape for k, v in state.items()}
        self.specs = {k: _spec(k) for k in state}
        self.params = {k: global_array(_view(k, v, cfg.n_head), self._sharding(self.specs[k]))
                       for k, v in state.items()}
        self._step = jax.jit(self._build(dp_reduce))

    def _build(self, dp_reduce: str):
        jax = _jax()
        jnp = jax.numpy
        from jax.sharding import PartitionSpec as P

        dp, lr, n_layer = self.dp, self.lr, self.cfg.n_layer

        def device_step(params, x, y, n_valid):
            loss, grads = jax.value_and_grad(partial(local_loss, n_layer=n_layer))(params, x, y, n_valid)
            names = sorted(grads)  # one flat bucket, so the ring runs once per step
            flat = jnp.concatenate([grads[k].reshape(-1) for k in names])
            if dp_reduce == "ring":
                flat = ring_all_reduce(flat, "dp", dp)
            else:
                flat = jax.lax.psum(flat, "dp")
            new, at = {}, 0
            for k in names:
                g = flat[at:at + grads[k].size].reshape(grads[k].shape)
                at += grads[k].size
                new[k] = params[k] - lr * g
            return new, jax.lax.psum(loss, "dp")

        specs = self.specs
        return jax.shard_map(device_step, mesh=self.mesh, in_specs=(specs, P("dp"), P("dp"), P()),
                             out_specs=(specs, P()), check_vma=False)

    def _sharding(self, spec):
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, spec)

    def _inputs(self, x, y):
        """Global arrays: x and y sharded over dp by rows, N (the valid-token count) replicated."""
        from jax.sharding import PartitionSpec as P

        x, y = np.asarray(x), np.asarray(y)
        if x.shape[0] % self.dp:
            raise ValueError(f"batch of {x.shape[0]} rows does not split over dp={self.dp}")
        n_valid = np.asarray(max(int((y != -1).sum()), 1), np.dtype(self.cfg.dtype))
        rows = self._sharding(P("dp"))
        return global_array(x, rows), global_array(y, rows), global_array(n_valid, self._sharding(P()))

    def step(self, x, y) -> float:
        """One SGD step; the loss comes out replicated on every device, so every process reads it."""
        self.params, loss = self._step(self.params, *self._inputs(x, y))
        return float(loss)

    def state(self) -> dict:
        """The parameters in minidist's names and shapes (host NumPy, full arrays). One process
        only: across processes each holds just its shards (compare them with ``shard_diff``)."""
        if not all(v.is_fully_addressable for v in self.params.values()):
            import jax

            raise ValueError(f"process {jax.process_index()}: the program's parameters span "
                             f"{jax.process_count()} processes, this one holds only its shards; "
                             "use shard_diff(state) to compare them")
        return {k: np.asarray(v).reshape(self.shapes[k]) for k, v in self.params.items()}

    def shard_diff(self, state: dict) -> float:
        """Largest |difference| between the parameter shards on this process's devices and the same
        pieces of ``state`` (full arrays in minidist's names and shapes, e.g. the serial twin's)."""
        worst = 0.0
        for k, v in self.params.items():
            want = _view(k, np.asarray(state[k]), self.cfg.n_head)
            for shard in v.addressable_shards:
                got = np.asarray(shard.data)
                worst = max(worst, float(np.max(np.abs(got - want[shard.index]), initial=0.0)))
        return worst

    def compiled_text(self, x, y) -> str:
        return self._step.lower(self.params, *self._inputs(x, y)).compile().as_text()


def collective_counts(hlo: str) -> dict:
    """How many of each collective an HLO module holds (async pairs counted once, at their start)."""
    counts = {}
    for name in ("all-reduce", "collective-permute", "all-gather", "reduce-scatter", "all-to-all"):
        counts[name] = len(re.findall(rf"= [^=\n]*\b{name}(?:-start)?\(", hlo))
    return counts
