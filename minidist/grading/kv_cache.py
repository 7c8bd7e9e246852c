"""Grader for exercises/kv_cache.py: one cached attention step, and a paged cache's gather and append.

``cached_attention_step`` decodes a random sequence position by position; each output must equal row
t of full causal attention (written out here), and the cache must hold every key and value. The
paged functions interleave several sequences in one pool; every sequence must read back its history.
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.grading import assert_close, untouched

GRADE = settings(max_examples=15, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
TOL = dict(rtol=1e-10, atol=1e-12)


def _causal_attention(q, k, v):
    """(H, T, D) -> (H, T, D): softmax(q k^T / sqrt(D) + causal mask) v, the formula written out."""
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


CACHED_ARGS = ["q", "k_new", "v_new", "cache_k", "cache_v", "pos"]
APPEND_ARGS = ["pool", "block_table", "free_blocks", "length", "kv", "block_size"]


def check_cached_attention_step(impl):
    @GRADE
    @given(h=st.integers(1, 3), t=st.integers(1, 6), d=st.integers(1, 4), extra=st.integers(0, 3),
           seed=st.integers(0, 9))
    @example(h=2, t=3, d=4, extra=2, seed=0)
    def prop(h, t, d, extra, seed):
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal((h, t, d)) for _ in range(3))
        want = _causal_attention(q, k, v)
        ck, cv = np.zeros((h, t + extra, d)), np.zeros((h, t + extra, d))
        step = untouched(impl.cached_attention_step, CACHED_ARGS, writes=("cache_k", "cache_v"))
        for pos in range(t):
            got = step(q[:, pos], k[:, pos], v[:, pos], ck, cv, pos)
            assert_close(got, want[:, pos], f"{h} heads, D={d}, cache of {t + extra} slots, step pos={pos} "
                                            f"(attend to positions 0..{pos}, scaled by 1/sqrt(D))", **TOL)
        assert_close(ck[:, :t], k, f"{h} heads, D={d}: cache_k after {t} steps (write k_new at pos)")
        assert_close(cv[:, :t], v, f"{h} heads, D={d}: cache_v after {t} steps (write v_new at pos)")
    prop()


def check_paged_gather(impl):
    @GRADE
    @given(bs=st.integers(1, 4), length=st.integers(0, 10), d=st.integers(1, 3), seed=st.integers(0, 9))
    @example(bs=2, length=3, d=2, seed=0)  # a half-full last block
    def prop(bs, length, d, seed):
        rng = np.random.default_rng(seed)
        n_blocks = -(-length // bs)
        pool = rng.standard_normal((n_blocks + 3, bs, d))
        table = [int(b) for b in rng.permutation(n_blocks + 3)[:n_blocks]]
        want = np.concatenate([pool[b] for b in table])[:length] if table else np.zeros((0, d))
        got = untouched(impl.paged_gather, ["pool", "block_table", "length", "block_size"])(
            pool, table, length, bs)
        assert_close(got, want, f"block_size {bs}, length {length}, block_table {table}")
    prop()


def check_paged_append(impl):
    @GRADE
    @given(bs=st.integers(1, 3), n_seq=st.integers(1, 3), d=st.integers(1, 2),
           order=st.lists(st.integers(0, 2), min_size=1, max_size=14), seed=st.integers(0, 9))
    @example(bs=2, n_seq=2, d=1, order=[0, 1, 0, 0, 1, 0], seed=0)
    def prop(bs, n_seq, d, order, seed):
        rng = np.random.default_rng(seed)
        n_blocks = len(order) + 1
        pool = np.full((n_blocks, bs, d), np.nan)
        free = list(range(n_blocks))
        append = untouched(impl.paged_append, APPEND_ARGS, writes=("pool", "block_table", "free_blocks"))
        tables, lengths, history = [[] for _ in range(n_seq)], [0] * n_seq, [[] for _ in range(n_seq)]
        for i, s in enumerate(o % n_seq for o in order):
            kv = rng.standard_normal(d)
            want_pop = free[-1] if lengths[s] % bs == 0 else None
            lengths[s] = append(pool, tables[s], free, lengths[s], kv, bs)
            history[s].append(kv)
            what = f"block_size {bs}, append #{i} to sequence {s} (now {len(history[s])} long)"
            assert lengths[s] == len(history[s]), f"{what}: returned length {lengths[s]}"
            assert len(tables[s]) == -(-lengths[s] // bs), (
                f"{what}: block_table {tables[s]} has {len(tables[s])} blocks, needs ceil({lengths[s]}/{bs})")
            if want_pop is not None:
                assert tables[s][-1] == want_pop, \
                    f"{what}: took block {tables[s][-1]}, expected free_blocks.pop() = {want_pop}"
            used = [b for t in tables for b in t]
            assert len(set(used)) == len(used) and not set(used) & set(free), (
                f"{what}: a block is in two tables or still free: tables {tables}, free {free}")
            got = np.concatenate([pool[b] for b in tables[s]])[:lengths[s]]
            assert_close(got, np.array(history[s]), f"{what}: the sequence read back through its table")
    prop()


CHECKS = {"cached_attention_step": check_cached_attention_step, "paged_gather": check_paged_gather,
          "paged_append": check_paged_append}
POINTS = {"cached_attention_step": 3, "paged_gather": 2, "paged_append": 3}


# -- minidist's own answer (must pass) -------------------------------------------------------------

def _step(q, k_new, v_new, cache_k, cache_v, pos, see_new=True, scale=True, window=None):
    cache_k[:, pos], cache_v[:, pos] = k_new, v_new
    end = pos + 1 if see_new else max(pos, 1)
    end = end if window is None else window
    s = np.einsum("hd,htd->ht", q, cache_k[:, :end]) / (np.sqrt(q.shape[-1]) if scale else 1.0)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("ht,htd->hd", w / w.sum(axis=-1, keepdims=True), cache_v[:, :end])


def _gather(pool, block_table, length, block_size):
    blocks = [pool[b] for b in block_table]
    return np.concatenate(blocks)[:length] if blocks else np.zeros((0, pool.shape[-1]), pool.dtype)


def _append(pool, block_table, free_blocks, length, kv, block_size, when=0):
    if length % block_size == when:
        block_table.append(free_blocks.pop())
    pool[block_table[length // block_size], length % block_size] = kv
    return length + 1


def reference():
    return types.SimpleNamespace(cached_attention_step=_step, paged_gather=_gather, paged_append=_append)


# -- deliberately broken implementations (must fail) -----------------------------------------------

def _step_without_new_token(q, k_new, v_new, cache_k, cache_v, pos):  # attends to 0..pos-1 (and 0 at pos 0)
    return _step(q, k_new, v_new, cache_k, cache_v, pos, see_new=False)


def _step_unscaled(q, k_new, v_new, cache_k, cache_v, pos):  # forgot 1/sqrt(D)
    return _step(q, k_new, v_new, cache_k, cache_v, pos, scale=False)


def _step_whole_cache(q, k_new, v_new, cache_k, cache_v, pos):  # attends to empty slots too
    return _step(q, k_new, v_new, cache_k, cache_v, pos, window=cache_k.shape[1])


def _gather_logical(pool, block_table, length, block_size):  # ignores the table: block i is pool[i]
    return np.concatenate(list(pool))[:length]


def _gather_whole_blocks(pool, block_table, length, block_size):  # returns the unused tail of the last block
    return _gather(pool, block_table, len(block_table) * block_size, block_size)


def _append_off_by_one(pool, block_table, free_blocks, length, kv, block_size):  # `<=`: a block too many
    if len(block_table) * block_size <= length + 1:
        block_table.append(free_blocks.pop())
    return _place(pool, block_table, length, kv, block_size)


def _place(pool, block_table, length, kv, block_size):
    pool[block_table[length // block_size], length % block_size] = kv
    return length + 1


def _append_first_free(pool, block_table, free_blocks, length, kv, block_size):  # takes free_blocks[0]
    if length % block_size == 0:
        block_table.append(free_blocks.pop(0))
    return _place(pool, block_table, length, kv, block_size)


def _step_scales_q_in_place(q, k_new, v_new, cache_k, cache_v, pos):  # right output, but `q /= sqrt(D)`
    q /= np.sqrt(q.shape[-1])                                            # writes into the caller's q
    return _step(q * np.sqrt(q.shape[-1]), k_new, v_new, cache_k, cache_v, pos)


BROKEN = {"cached_attention_step": [_step_without_new_token, _step_unscaled, _step_whole_cache,
                                    _step_scales_q_in_place],
          "paged_gather": [_gather_logical, _gather_whole_blocks],
          "paged_append": [_append_off_by_one, _append_first_free]}
