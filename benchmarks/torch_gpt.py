"""minidist's GPT written in PyTorch: the reference the benchmarks measure against.

``TorchGPT(cfg)`` has minidist's layer layout (token + position embedding, pre-norm blocks with
causal self-attention and a tanh-GELU MLP, final LayerNorm, LM head without bias).
``from_minidist(state_dict, cfg)`` builds one holding a minidist ``GPT``'s weights, so both start
from the same numbers: minidist's Linear weights are (in, out), PyTorch's (out, in), so they are
transposed on the way in. ``model(idx, targets)`` gives the mean cross-entropy (training), and
``model(idx)`` the logits (B, T, vocab). ``generate`` decodes greedily, with a preallocated KV
cache (``new_cache``) or, for comparison, by recomputing the whole sequence for every token.

Imports torch at the top: a benchmark imports this module only once it knows torch is installed.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """x + proj(attention(ln1(x))), then + out(gelu(fc(ln2(x)))); writes into a KV cache if given one."""

    def __init__(self, cfg):
        super().__init__()
        d, self.n_head = cfg.d_model, cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, cache=None, start: int = 0):
        # the layers are called through F.* on their parameters: a module call costs microseconds,
        # which would count against PyTorch when decoding one token at a time
        b, t, c = x.shape
        qkv = F.linear(_norm(x, self.ln1), self.qkv.weight, self.qkv.bias)
        q, k, v = qkv.view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        if cache is not None:  # keep this step's keys and values, attend over all so far
            kc, vc = cache
            kc[:b, :, start:start + t], vc[:b, :, start:start + t] = k, v
            k, v = kc[:b, :, :start + t], vc[:b, :, :start + t]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        x = x + F.linear(y.transpose(1, 2).reshape(b, t, c), self.proj.weight, self.proj.bias)
        h = F.gelu(F.linear(_norm(x, self.ln2), self.fc.weight, self.fc.bias), approximate="tanh")
        return x + F.linear(h, self.out.weight, self.out.bias)


def _norm(x, ln):
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


class TorchGPT(nn.Module):
    """Embedding, n_layer Blocks, LayerNorm, LM head: the same model as ``minidist.nn.GPT``."""

    def __init__(self, cfg):
        super().__init__()
        d, self.cfg = cfg.d_model, cfg
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, d), nn.Embedding(cfg.block_size, d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, cfg.vocab_size, bias=False)

    def forward(self, idx, targets=None, cache=None, start: int = 0):
        """Mean cross-entropy against ``targets``, or the logits without them.

        With ``cache`` (from ``new_cache``), ``idx`` holds positions start..start+T-1, and their keys
        and values are stored there; several tokens at once only from position 0 (the prompt).
        """
        t = idx.shape[1]
        if cache is not None and t > 1 and start > 0:
            raise ValueError(f"TorchGPT: {t} tokens at position {start}: with a KV cache, feed the prompt "
                             "from position 0, then one token at a time")
        x = self.wte(idx) + self.wpe(torch.arange(start, start + t))
        for i, blk in enumerate(self.blocks):
            x = blk(x) if cache is None else blk(x, cache[i], start)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def new_cache(self, batch: int, max_len: int):
        """Per layer, preallocated keys and values (batch, heads, max_len, head_dim)."""
        h = self.cfg.n_head
        shape = (batch, h, max_len, self.cfg.d_model // h)
        return [(torch.empty(shape), torch.empty(shape)) for _ in self.blocks]

    @torch.inference_mode()
    def generate(self, prompt, n: int, use_cache: bool = True) -> list:
        """``n`` greedy tokens after ``prompt`` (a list of ids), batch 1."""
        toks = list(prompt)
        if not use_cache:
            for _ in range(n):
                toks.append(int(self(torch.tensor([toks]))[0, -1].argmax()))
            return toks[len(prompt):]
        cache = self.new_cache(1, len(prompt) + n)
        logits = self(torch.tensor([toks]), cache=cache)
        for _ in range(n):
            toks.append(int(logits[0, -1].argmax()))
            if len(toks) - len(prompt) == n:
                break
            logits = self(torch.tensor([[toks[-1]]]), cache=cache, start=len(toks) - 1)
        return toks[len(prompt):]


def from_minidist(state_dict, cfg) -> TorchGPT:
    """A ``TorchGPT`` holding the weights of a minidist ``GPT(cfg)``'s ``state_dict()``."""
    m, L = TorchGPT(cfg), cfg.n_layer + 1

    def put(param, key, transpose=False):
        a = np.asarray(state_dict[key])
        param.copy_(torch.from_numpy(np.ascontiguousarray(a.T if transpose else a)))

    with torch.no_grad():
        put(m.wte.weight, "0.wte.weight")
        put(m.wpe.weight, "0.wpe.weight")
        for i, blk in enumerate(m.blocks, 1):
            for mine, theirs in (("ln1", blk.ln1), ("ln2", blk.ln2)):
                put(theirs.weight, f"{i}.{mine}.weight")
                put(theirs.bias, f"{i}.{mine}.bias")
            for mine, theirs in (("attn.qkv", blk.qkv), ("attn.proj", blk.proj), ("mlp.fc", blk.fc),
                                 ("mlp.proj", blk.out)):
                put(theirs.weight, f"{i}.{mine}.weight", transpose=True)
                put(theirs.bias, f"{i}.{mine}.bias")
        put(m.ln.weight, f"{L}.ln.weight")
        put(m.ln.bias, f"{L}.ln.bias")
        put(m.head.weight, f"{L}.proj.weight", transpose=True)
    return m
