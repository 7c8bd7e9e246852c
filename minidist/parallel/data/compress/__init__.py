"""DDP communication hooks: send fewer bytes per gradient, keep every replica identical.

``ddp.register_comm_hook(state, hook)``, PyTorch's contract: ``hook(state, bucket)`` (a ``GradBucket``)
returns a Handle whose ``wait()`` is the bucket's gradient summed over ranks. DDP calls the hook
when a bucket is complete and divides what the handle returns by the global batch, as for its
all-reduce. A hook encodes, communicates and decodes on the async worker (``bucket.start``),
overlapping backward; every rank decodes the same bytes in the same order, so the result is
bit-identical on every rank. One file per idea:

* dense.py    -- ``allreduce_hook`` (the default, a plain all-reduce); ``reduce_with_hook`` outside DDP
* cast.py     -- fp16 / bf16: half the bytes (``cast_all_reduce``; mixed precision uses it too)
* sparse.py   -- top-k / random-k with error feedback, (index, value) pairs by all-gather
* qsgd.py     -- QSGD: s levels, stochastic rounding (unbiased), bit-packed, norm alongside
* sign.py     -- 1-bit sign with error feedback and one scale per bucket (EF-signSGD)
* fp8.py      -- FP8 (e4m3) codes with a power-of-two scale per chunk: all-to-all, fp32 sum, all-gather
* powersgd.py -- PowerSGD rank r: error feedback, warm start, Gram-Schmidt, K dense warm-up steps

``make_hook("topk", ratio=0.01)`` builds a (state, hook) pair by name (lessons, benchmarks).
"""

from minidist.parallel.data.buckets import GradBucket
from minidist.parallel.data.compress.cast import CastState, cast_all_reduce, cast_hook
from minidist.parallel.data.compress.dense import allreduce_hook, reduce_with_hook
from minidist.parallel.data.compress.fp8 import Fp8State, fp8_hook
from minidist.parallel.data.compress.powersgd import PowerSGDState, orthogonalize, powersgd_hook
from minidist.parallel.data.compress.qsgd import QSGDState, qsgd_decode, qsgd_encode, qsgd_hook
from minidist.parallel.data.compress.sign import SignState, sign_hook
from minidist.parallel.data.compress.sparse import SparseState, ef_sparsify, sparse_hook, sparse_sum


def make_hook(name: str, **kw) -> tuple:
    """(state, hook) for ``name`` in dense | bf16 | fp16 | fp8 | topk | randk | qsgd | sign | powersgd."""
    table = {"dense": lambda: (None, allreduce_hook),
             "bf16": lambda: (CastState("bf16"), cast_hook), "fp16": lambda: (CastState("fp16"), cast_hook),
             "fp8": lambda: (Fp8State(), fp8_hook),
             "topk": lambda: (SparseState(kind="topk", **kw), sparse_hook),
             "randk": lambda: (SparseState(kind="randk", **kw), sparse_hook),
             "qsgd": lambda: (QSGDState(**kw), qsgd_hook), "sign": lambda: (SignState(**kw), sign_hook),
             "powersgd": lambda: (PowerSGDState(**kw), powersgd_hook)}
    if name not in table:
        raise ValueError(f"unknown compression hook {name!r}; use one of {sorted(table)}")
    return table[name]()


__all__ = ["CastState", "GradBucket", "PowerSGDState", "QSGDState", "SignState", "SparseState",
           "allreduce_hook", "cast_all_reduce", "cast_hook", "ef_sparsify", "make_hook", "orthogonalize",
           "powersgd_hook", "qsgd_decode", "qsgd_encode", "qsgd_hook", "reduce_with_hook", "sign_hook",
           "sparse_hook", "sparse_sum"]
