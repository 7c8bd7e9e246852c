"""Grader for exercises/allreduce.py: property tests that take the implementation as a parameter.

``check_<task>(impl)`` raises AssertionError when ``impl.<task>`` is wrong. Here they run against
minidist's own algorithms (they must pass) and deliberately broken ones (they must fail), so the
grader can't be silently toothless. ``python -m minidist.grade allreduce`` runs the same checks
against a student's file. Every check runs on the rendezvous transport (a send completes only when
the receive is posted, like MPI with large messages): a ring of blocking send-then-receive fails
with the cycle of waiting ranks.
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.comm import collectives as C
from minidist.comm import measure
from minidist.comm.collectives import split_sizes
from minidist.grading import assert_close, no_hang, run_guarded

GRADE = settings(max_examples=12, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)


def _run_measured(impl, p, fn):
    """Run ``fn(comm)`` on p ranks (a hang fails in seconds); per rank: (result, messages sent,
    bytes sent). A task that runs one of minidist's own collectives (the ledger records each call)
    fails: the exercise is to build it from point-to-point messages."""
    def body(comm):
        with measure(comm) as m:
            out = fn(comm)
        return out, m.messages, m.bytes_sent, [c.name for c in m.calls]
    out = run_guarded(body, ranks=p, rendezvous=True)
    if not getattr(impl, "minidist_reference", False):  # minidist's own code may call itself
        for r, (*_, calls) in enumerate(out):
            assert not calls, (f"rank {r} of {p} ran minidist's own collective(s) {calls}: write it "
                               f"from comm.send / comm.recv / comm.sendrecv")
    return [o[:3] for o in out]


def _inputs(p, n, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n) for _ in range(p)]


def check_ring_all_reduce(impl):
    @GRADE
    @given(p=st.integers(1, 8), n=st.integers(0, 50), seed=st.integers(0, 9))
    @example(p=3, n=4, seed=0)  # chunks of 2, 1, 1 elements: only the spec's convention sends these bytes
    def prop(p, n, seed):
        xs = _inputs(p, n, seed)
        want = np.sum(xs, axis=0)
        out = _run_measured(impl, p, lambda c: impl.ring_all_reduce(c, xs[c.rank]))
        chunk = [8 * k for k in split_sizes(n, p)]  # bytes of each np.array_split chunk (float64)
        for r, (y, msgs, sent) in enumerate(out):
            assert_close(y, want, f"rank {r} of {p} ranks, n={n} float64", rtol=1e-10, atol=1e-10)
            assert msgs == 2 * (p - 1), f"rank {r} of {p} sent {msgs} messages, a ring sends 2(p-1)"
            # every chunk but its own in reduce-scatter, every chunk but r+1 in all-gather
            exact = 2 * 8 * n - chunk[r] - chunk[(r + 1) % p] if p > 1 else 0
            assert sent == exact, (f"rank {r} of {p} sent {sent} bytes; the ring of the spec (rank r ends "
                                   f"the reduce-scatter owning chunk r) sends 2N - |c_r| - |c_r+1| = {exact}")
    no_hang(prop)


def check_recursive_doubling_all_reduce(impl):
    @GRADE
    @given(p=st.integers(1, 8), n=st.integers(0, 20), seed=st.integers(0, 9))
    def prop(p, n, seed):
        xs = _inputs(p, n, seed)
        want = np.sum(xs, axis=0)
        q = 1 << (p.bit_length() - 1)
        out = _run_measured(impl, p, lambda c: impl.recursive_doubling_all_reduce(c, xs[c.rank]))
        for r, (y, msgs, _) in enumerate(out):
            assert_close(y, want, f"rank {r} of {p} ranks, n={n} float64", rtol=1e-10, atol=1e-10)
            limit = q.bit_length() - 1 + (1 if q < p else 0)
            assert msgs <= limit, f"rank {r} of {p} sent {msgs} messages; at most {limit}"
    no_hang(prop)


def check_tree_broadcast(impl):
    @GRADE
    @given(p=st.integers(1, 8), n=st.integers(0, 20), seed=st.integers(0, 9), data=st.data())
    def prop(p, n, seed, data):
        root = data.draw(st.integers(0, p - 1))
        x = _inputs(1, n, seed)[0]
        out = _run_measured(impl, p, lambda c: impl.tree_broadcast(c, x if c.rank == root else None, root))
        limit = (p - 1).bit_length()
        for r, (y, msgs, _) in enumerate(out):
            assert_close(y, x, f"rank {r} of {p} ranks, root {root}, n={n} float64")
            assert msgs <= limit, f"rank {r} of {p} sent {msgs} messages; a binomial tree sends <= {limit}"
        assert sum(m for _, m, _ in out) == p - 1, "every rank but the root must receive exactly once"
    no_hang(prop)


CHECKS = {"ring_all_reduce": check_ring_all_reduce,
          "recursive_doubling_all_reduce": check_recursive_doubling_all_reduce,
          "tree_broadcast": check_tree_broadcast}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def reference():
    def tree_broadcast(comm, x, root=0):
        return C.broadcast(comm, x, root)
    return types.SimpleNamespace(ring_all_reduce=C.ring_all_reduce,
                                 recursive_doubling_all_reduce=C.recursive_doubling_all_reduce,
                                 tree_broadcast=tree_broadcast, minidist_reference=True)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _naive_sum(comm, x):  # right answer, wrong algorithm: everyone sends everything to everyone
    total = x.copy()
    for k in range(1, comm.size):
        total = total + comm.sendrecv(x, (comm.rank + k) % comm.size, (comm.rank - k) % comm.size)
    return total


def _ring_off_by_one(comm, x):  # one all-gather step short: a chunk stays partial
    p, r = comm.size, comm.rank
    chunks = [c.copy() for c in np.array_split(x, p)]
    for s in range(p - 1):
        chunks[(r - s - 1) % p] += comm.sendrecv(chunks[(r - s) % p], (r + 1) % p, (r - 1) % p)
    for s in range(p - 2):
        chunks[(r - s) % p] = comm.sendrecv(chunks[(r - s + 1) % p], (r + 1) % p, (r - 1) % p)
    return np.concatenate(chunks) if chunks else x


def _doubling_pow2_only(comm, x):  # ignores the fold for p not a power of two
    y, d = x.copy(), 1
    while d < comm.size:
        peer = comm.rank ^ d
        if peer < comm.size:
            y = y + comm.sendrecv(y, peer, peer)
        d *= 2
    return y


def _ring_next_chunk(comm, x):  # a convention the spec rules out: rank r ends the reduce-scatter owning r+1
    p, r = comm.size, comm.rank
    chunks = [c.copy() for c in np.array_split(x, p)]
    for s in range(p - 1):
        chunks[(r - s - 1) % p] += comm.sendrecv(chunks[(r - s) % p], (r + 1) % p, (r - 1) % p)
    for s in range(p - 1):
        chunks[(r - s) % p] = comm.sendrecv(chunks[(r - s + 1) % p], (r + 1) % p, (r - 1) % p)
    return np.concatenate(chunks)


def _library_all_reduce(comm, x):  # right answer, right messages -- but minidist's own code
    return C.ring_all_reduce(comm, x)


def _library_broadcast(comm, x, root=0):  # the binomial tree, by calling minidist's broadcast
    return C.broadcast(comm, x, root)


def _blocking_ring(comm, x):  # the textbook ring with send-then-recv: fine when sends are buffered,
    p, r = comm.size, comm.rank  # a deadlock on MPI with large messages (and on the grader's transport)
    chunks = [c.copy() for c in np.array_split(x, p)]
    for s in range(p - 1):
        comm.send(chunks[(r - s - 1) % p], (r + 1) % p)
        chunks[(r - s - 2) % p] += comm.recv((r - 1) % p)
    for s in range(p - 1):
        comm.send(chunks[(r - s) % p], (r + 1) % p)
        chunks[(r - s - 1) % p] = comm.recv((r - 1) % p)
    return np.concatenate(chunks)


def _flat_broadcast(comm, x, root=0):  # root sends to everyone: p-1 messages from the root
    if comm.rank == root:
        for r in range(comm.size):
            if r != root:
                comm.send(x, r)
        return x
    return comm.recv(root)


BROKEN = {
    "ring_all_reduce": [_naive_sum, _ring_off_by_one, _ring_next_chunk, _library_all_reduce, _blocking_ring],
    "recursive_doubling_all_reduce": [_doubling_pow2_only, _naive_sum],
    "tree_broadcast": [_flat_broadcast, _library_broadcast],
}
