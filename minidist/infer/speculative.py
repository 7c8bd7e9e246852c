"""Speculative decoding: a small draft model guesses k tokens, the target checks them in one pass.

    speculative_generate(target, draft, prompts, max_new_tokens, k=4)   # == generate(target, ...)

Each proposal d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)) (p: the target's
distribution, q: the draft's); at the first rejection a token is drawn from norm(max(0, p_i - q_i))
and the round ends; if all k survive, one more comes free from p_{k+1}. Every emitted token then has
exactly the target's distribution (``verify``); greedy, the target's own tokens. Both models keep a
KV cache; a rejected proposal is rolled back by setting the slot's length to the tokens kept.
Chapter 9 has the proof and the speed-up formula (``expected_speedup``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minidist.autograd.tensor import no_grad
from minidist.infer.decoder import as_decoder, forward_tokens
from minidist.infer.generate import check_ids, check_prompts, host, is_done, stop_set
from minidist.infer.kv_cache import KVCache
from minidist.infer.sampling import GREEDY, SamplingParams, check_finite, filter_probs, is_int
from minidist.trace.spans import now

# -- the acceptance rule (exercises/speculative.py asks for these) ------------------------------------


def probs(logits, sampling: SamplingParams) -> np.ndarray:
    """The distribution a token is drawn from, (V,) float64: greedy is one-hot on the argmax."""
    if sampling.temperature == 0.0:
        p = np.zeros(np.shape(logits)[-1])
        p[int(np.argmax(logits))] = 1.0
        return p
    return filter_probs(logits, sampling)


def pick(dist, v: float) -> int:
    """The token the uniform ``v`` in [0, 1) selects from ``dist`` by inverse CDF: the first j with
    cumsum(dist)[j] > v · sum(dist). A token of probability 0 is never picked."""
    c = np.cumsum(dist)
    return int(min(np.searchsorted(c, v * c[-1], side="right"), len(c) - 1))


def residual(p, q) -> np.ndarray:
    """norm(max(0, p - q)): where a rejected proposal's replacement is drawn from. It puts the mass
    the draft under-proposes back, so acceptance + replacement together give exactly p. (If p == q
    nothing is ever rejected; p is returned rather than 0/0.)"""
    r = np.maximum(np.asarray(p, dtype=np.float64) - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else np.asarray(p, dtype=np.float64)


def verify(p, q, drafts, u, v: float) -> list:
    """The tokens one round emits: the accepted prefix of ``drafts`` and one more.

    p (k+1, V): the target's distributions at each proposal and after the last; q (k, V): the
    draft's; ``drafts`` (k,) the proposals; ``u`` (k,) and ``v`` uniforms in [0, 1). Proposal i is
    accepted iff u_i < p_i(d_i) / q_i(d_i) (written u_i·q_i(d_i) < p_i(d_i): no division); at the
    first rejection the round ends with ``pick(residual(p_i, q_i), v)``; if none is rejected, with
    ``pick(p_k, v)``."""
    out = []
    for i, d in enumerate(drafts):
        d = int(d)
        if u[i] * q[i][d] < p[i][d]:
            out.append(d)
            continue
        out.append(pick(residual(p[i], q[i]), v))
        return out
    out.append(pick(p[len(drafts)], v))
    return out


def expected_speedup(a: float, k: int, c: float) -> float:
    """Leviathan et al.'s speed-up over plain decoding: (1 - a^(k+1)) / ((1 - a)(k·c + 1)), the
    expected tokens per round over its cost in target steps (a = 1: (k + 1) / (k·c + 1))."""
    tokens = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    return tokens / (k * c + 1.0)


# -- generation ----------------------------------------------------------------------------------------


@dataclass
class SpecStats:
    """What a ``speculative_generate`` call did, summed over its sequences."""

    rounds: int = 0          # verify passes' rows: one per sequence per round
    proposed: int = 0        # draft tokens offered
    accepted: int = 0        # of them kept
    rejected: int = 0        # rounds ended by a rejection (the proposals after it are never judged)
    tokens: int = 0          # tokens emitted (after the first, which the prefill gives)
    target_passes: int = 0   # target forwards (the prefill included)
    draft_passes: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """a: of the proposals judged (up to a round's first rejection), the share kept."""
        return self.accepted / (self.accepted + self.rejected) if self.accepted + self.rejected else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0


def check_pair(target, draft, k) -> tuple:
    """The two decoders, after the checks that make a pair usable: same vocabulary, k >= 1."""
    if not (is_int(k) and k >= 1):
        raise ValueError(f"speculative decoding: k (tokens proposed per round) must be an integer >= 1, "
                         f"got {k!r}")
    t, d = as_decoder(target), as_decoder(draft)
    if t.vocab_size != d.vocab_size:
        raise ValueError(f"speculative decoding: the draft's vocab_size {d.vocab_size} differs from the "
                         f"target's {t.vocab_size}; the draft must propose the target's token ids")
    return t, d


def speculative_generate(target, draft, prompts, max_new_tokens: int, k: int = 4,
                         sampling: SamplingParams = GREEDY, stop_tokens=(), ids=None,
                         stats: SpecStats | None = None) -> list:
    """New tokens for each prompt, as ``generate(target, ...)`` would give them in distribution
    (greedy: token for token). ``draft``: a smaller model over the same vocabulary; ``k``: tokens
    it proposes per round. ``ids``: each sequence's generator stream (default 0, 1, ...);
    ``stats``: a ``SpecStats`` to add this call's counts and times to."""
    tdec, ddec = check_pair(target, draft, k)
    prompts = check_prompts(prompts, min(tdec.block_size, ddec.block_size), tdec.vocab_size, max_new_tokens)
    n, st = len(prompts), SpecStats() if stats is None else stats
    max_len = max(len(p) for p in prompts) + max_new_tokens
    tc, dc = KVCache.for_decoder(tdec, n, max_len), KVCache.for_decoder(ddec, n, max_len)
    ids = check_ids(ids, n)
    rngs = [sampling.generator(i) for i in ids]
    stop, outs, seqs = stop_set(stop_tokens), [[] for _ in prompts], [list(p) for p in prompts]
    active = list(range(n)) if max_new_tokens > 0 else []

    def run(dec, cache, rows, feed):
        t0 = now()
        out = host(forward_tokens(dec, cache, rows, feed))
        dt = now() - t0
        if dec is tdec:
            st.target_passes, st.target_seconds = st.target_passes + 1, st.target_seconds + dt
        else:
            st.draft_passes, st.draft_seconds = st.draft_passes + 1, st.draft_seconds + dt
        return out

    def emit(i, toks):
        for t in toks:
            outs[i].append(t)
            seqs[i].append(t)
            if is_done(outs[i], max_new_tokens, stop):
                break

    with no_grad():
        if active:  # prefill the target; the first token is the target's own (the draft catches up)
            logits = run(tdec, tc, active, prompts)
            check_finite(logits[active, [len(q) - 1 for q in prompts]], ids, 0, "the target's")
            for i in active:
                emit(i, [pick(probs(logits[i, len(prompts[i]) - 1], sampling), rngs[i].random())])
            active = [i for i in active if not is_done(outs[i], max_new_tokens, stop)]
        while active:
            ks = {i: min(k, max_new_tokens - len(outs[i]) - 1) for i in active}
            props, qs = {i: [] for i in active}, {i: [] for i in active}
            for j in range(max(ks.values())):  # the draft proposes, one pass per step for the batch
                rows = [i for i in active if ks[i] > j]
                feed = [seqs[i][dc.lengths[i]:] if j == 0 else props[i][-1:] for i in rows]
                out = run(ddec, dc, rows, feed)
                for r, i in enumerate(rows):
                    check_finite(out[r, len(feed[r]) - 1], [ids[i]], len(outs[i]) + j, "the draft's")
                    q = probs(out[r, len(feed[r]) - 1], sampling)
                    props[i].append(pick(q, rngs[i].random()))
                    qs[i].append(q)
            feed = [seqs[i][tc.lengths[i]:] + props[i] for i in active]  # the last token + the proposals
            out = run(tdec, tc, active, feed)
            for r, i in enumerate(active):
                lag = len(feed[r]) - ks[i]  # committed tokens fed (1): p_1 is at position lag - 1
                check_finite(out[r, lag - 1:lag + ks[i]], [ids[i]], len(outs[i]), "the target's")
                p = [probs(out[r, lag - 1 + j], sampling) for j in range(ks[i] + 1)]
                new = verify(p, qs[i], props[i], rngs[i].random(ks[i]), rngs[i].random())
                before = len(outs[i])
                emit(i, new)
                keep = len(seqs[i]) - 1  # the newest token is fed next round: roll both caches back
                tc.lengths[i] = keep
                dc.lengths[i] = min(int(dc.lengths[i]), keep)
                st.rounds += 1
                st.proposed += ks[i]
                st.accepted += len(new) - 1
                st.rejected += len(new) - 1 < ks[i]
                st.tokens += len(outs[i]) - before
            active = [i for i in active if not is_done(outs[i], max_new_tokens, stop)]
    return outs
