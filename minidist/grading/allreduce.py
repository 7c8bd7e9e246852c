"""Grader for exercises/allreduce.py: property tests that take the implementation as a parameter.

``check_<task>(impl)`` raises AssertionError when ``impl.<task>`` is wrong. Here they run against
minidist's own algorithms (they must pass) and deliberately broken ones (they must fail), so the
grader can't be silently toothless. ``python -m minidist.grade allreduce`` runs the same checks
against a student's file. Every check runs on the rendezvous transport (a send completes only when
the receive is posted, like MPI with large messages): a ring of blocking send-then-receive fails
with the cycle of waiting ranks. Each check also counts communication rounds (rounds.py: the ring
2(p-1), the tree broadcast ceil(log2 p)) and fails a task that changes the caller's input. The
ring's byte check holds for every convention (``ACCEPTED``: owning chunk r or r+1 after the
reduce-scatter, running left or right): each rank sends 2N - |c_a| - |c_b| for the two chunks it
never sends, all ranks together 2(p-1)N.
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minidist.comm as C
from minidist.comm import measure
from minidist.grading import _fmt, assert_close, no_hang, run_guarded

GRADE = settings(max_examples=12, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)


def _run_measured(impl, p, fn, task, inputs):
    """Run ``fn(comm)`` on p ranks (a hang fails in seconds); per rank: (result, messages sent,
    bytes sent, rounds: see rounds.py). A task that runs one of minidist's own collectives (the
    ledger records each call) fails: the exercise is to build it from point-to-point messages. So
    does one that changes ``inputs[rank]``, the caller's array (None: nothing given)."""
    before = [None if x is None else x.copy() for x in inputs]

    def body(comm):
        with measure(comm) as m:
            out = fn(comm)
        return out, m.messages, m.bytes_sent, comm.rounds(), [c.name for c in m.calls]
    out = run_guarded(body, ranks=p, rendezvous=True)
    if not getattr(impl, "minidist_reference", False):  # minidist's own code may call itself
        for r, (*_, calls) in enumerate(out):
            assert not calls, (f"rank {r} of {p} ran minidist's own collective(s) {calls}: write it "
                               f"from comm.send / comm.recv / comm.sendrecv")
    for r, (x, was) in enumerate(zip(inputs, before)):
        if was is not None and not np.array_equal(x, was, equal_nan=True):
            k = int(np.flatnonzero(x != was)[0])
            raise AssertionError(f"rank {r} of {p}: {task} changed the caller's input x (x[{k}] was "
                                 f"{_fmt(was[k])}, is now {_fmt(x[k])}): the caller still owns x. "
                                 f"np.array_split returns views into x, so `chunk += ...` writes into "
                                 f"it; work on copies (x.copy(), or [c.copy() for c in chunks])")
    return [o[:4] for o in out]


def _inputs(p, n, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n) for _ in range(p)]


def _rounds_check(out, p, limit, what):
    rounds = max(o[3] for o in out)
    assert rounds <= limit, (f"at p={p} the {what} took {rounds} communication rounds, at most {limit} "
                             f"allowed (a round: each rank sends at most one message and receives at "
                             f"most one, sendrecv counts once; a message received in round t can go on "
                             f"in round t+1)")


def check_ring_all_reduce(impl):
    @GRADE
    @given(p=st.integers(1, 8), n=st.integers(0, 50), seed=st.integers(0, 9))
    @example(p=3, n=4, seed=0)  # chunks of 2, 1, 1 elements: unequal chunk sizes
    def prop(p, n, seed):
        xs = _inputs(p, n, seed)
        want = np.sum(xs, axis=0)
        out = _run_measured(impl, p, lambda c: impl.ring_all_reduce(c, xs[c.rank]), "ring_all_reduce", xs)
        big, small = -(-n // p) * 8, n // p * 8  # bytes of the largest / smallest np.array_split chunk
        for r, (y, msgs, sent, _) in enumerate(out):
            assert_close(y, want, f"rank {r} of {p} ranks, n={n} float64", rtol=1e-10, atol=1e-10)
            assert msgs == 2 * (p - 1), f"rank {r} of {p} sent {msgs} messages, a ring sends 2(p-1)"
            # every chunk but one in the reduce-scatter, every chunk but another in the all-gather:
            # 2N - |c_a| - |c_b|, whichever chunks a != b this rank's convention leaves out
            lo, hi = (2 * 8 * n - 2 * big, 2 * 8 * n - 2 * small) if p > 1 else (0, 0)
            assert lo <= sent <= hi, (f"rank {r} of {p} sent {sent} bytes; a ring sends every chunk but "
                                      f"one in each phase, 2N - |c_a| - |c_b| = {lo}..{hi} bytes for N = "
                                      f"{8 * n} bytes in chunks of {small // 8}..{big // 8} float64")
        total = sum(o[2] for o in out)
        assert total == 2 * (p - 1) * 8 * n, (f"the {p} ranks sent {total} bytes in all; a ring sends "
                                              f"each chunk p-1 times in each phase: 2(p-1)·N = "
                                              f"{2 * (p - 1) * 8 * n}")
        _rounds_check(out, p, 2 * (p - 1), "ring (p-1 reduce-scatter steps + p-1 all-gather steps)")
    no_hang(prop)


def check_recursive_doubling_all_reduce(impl):
    @GRADE
    @given(p=st.integers(1, 8), n=st.integers(0, 20), seed=st.integers(0, 9))
    def prop(p, n, seed):
        xs = _inputs(p, n, seed)
        want = np.sum(xs, axis=0)
        q = 1 << (p.bit_length() - 1)
        out = _run_measured(impl, p, lambda c: impl.recursive_doubling_all_reduce(c, xs[c.rank]),
                            "recursive_doubling_all_reduce", xs)
        for r, (y, msgs, _, _) in enumerate(out):
            assert_close(y, want, f"rank {r} of {p} ranks, n={n} float64", rtol=1e-10, atol=1e-10)
            limit = q.bit_length() - 1 + (1 if q < p else 0)
            assert msgs <= limit, f"rank {r} of {p} sent {msgs} messages; at most {limit}"
        _rounds_check(out, p, q.bit_length() - 1 + (2 if q < p else 0),
                      "recursive doubling (log2 q exchanges, plus the fold in and the result out when "
                      "p is not a power of two)")
    no_hang(prop)


def check_tree_broadcast(impl):
    @GRADE
    @given(p=st.integers(1, 8), n=st.integers(0, 20), seed=st.integers(0, 9), pick=st.integers(0, 7))
    @example(p=8, n=3, seed=0, pick=0)  # the deepest tree: 3 rounds, or 6 with children in the wrong order
    def prop(p, n, seed, pick):
        root = pick % p
        x = _inputs(1, n, seed)[0]
        out = _run_measured(impl, p, lambda c: impl.tree_broadcast(c, x if c.rank == root else None, root),
                            "tree_broadcast", [x if r == root else None for r in range(p)])
        limit = (p - 1).bit_length()
        for r, (y, msgs, _, _) in enumerate(out):
            assert_close(y, x, f"rank {r} of {p} ranks, root {root}, n={n} float64")
            assert msgs <= limit, f"rank {r} of {p} sent {msgs} messages; a binomial tree sends <= {limit}"
        assert sum(m for _, m, _, _ in out) == p - 1, "every rank but the root must receive exactly once"
        _rounds_check(out, p, limit, f"broadcast from root {root} (a binomial tree: ceil(log2 p) = {limit}; "
                                     f"send to the farthest child first)")
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


def _ring_in_place(comm, x):  # the spec's ring on np.array_split's views: `+=` writes into the caller's x
    p, r = comm.size, comm.rank
    chunks = np.array_split(x, p)
    for s in range(p - 1):
        chunks[(r - s - 2) % p] += comm.sendrecv(chunks[(r - s - 1) % p], (r + 1) % p, (r - 1) % p)
    for s in range(p - 1):
        chunks[(r - s - 1) % p] = comm.sendrecv(chunks[(r - s) % p], (r + 1) % p, (r - 1) % p)
    return np.concatenate(chunks)


def _ring_even_sends_first(comm, x):  # deadlock-free without sendrecv (even ranks send, odd receive
    p, r = comm.size, comm.rank      # first), but each step now costs two rounds: 4(p-1) in all

    def step(buf):
        if r % 2 == 0:
            comm.send(buf, (r + 1) % p)
            return comm.recv((r - 1) % p)
        got = comm.recv((r - 1) % p)
        comm.send(buf, (r + 1) % p)
        return got
    chunks = [c.copy() for c in np.array_split(x, p)]
    for s in range(p - 1):
        chunks[(r - s - 2) % p] += step(chunks[(r - s - 1) % p])
    for s in range(p - 1):
        chunks[(r - s - 1) % p] = step(chunks[(r - s) % p])
    return np.concatenate(chunks)


def _tree_broadcast(comm, x, root=0, farthest_first=True):
    """The binomial tree of the spec, written from send/recv; ``farthest_first=False`` sends to the
    children nearest first: the same messages, but the subtree under v + 2**k starts k rounds late."""
    p = comm.size
    v = (comm.rank - root) % p
    low = v & -v if v else 1 << max(p - 1, 0).bit_length()  # the root "receives" above every bit
    if v:
        x = comm.recv((v - low + root) % p)
    ks = [k for k in range(low.bit_length() - 1) if v + (1 << k) < p]
    for k in (reversed(ks) if farthest_first else ks):
        comm.send(x, (v + (1 << k) + root) % p)
    return x


def _tree_broadcast_nearest_first(comm, x, root=0):
    return _tree_broadcast(comm, x, root, farthest_first=False)


BROKEN = {
    "ring_all_reduce": [_naive_sum, _ring_off_by_one, _library_all_reduce, _blocking_ring, _ring_in_place,
                        _ring_even_sends_first],
    "recursive_doubling_all_reduce": [_doubling_pow2_only, _naive_sum],
    "tree_broadcast": [_flat_broadcast, _library_broadcast, _tree_broadcast_nearest_first],
}


# -- other correct answers the spec allows (must pass too) -----------------------------------------

def _ring_next_chunk(comm, x):  # rank r ends the reduce-scatter owning chunk r+1 (another convention)
    p, r = comm.size, comm.rank
    chunks = [c.copy() for c in np.array_split(x, p)]
    for s in range(p - 1):
        chunks[(r - s - 1) % p] += comm.sendrecv(chunks[(r - s) % p], (r + 1) % p, (r - 1) % p)
    for s in range(p - 1):
        chunks[(r - s) % p] = comm.sendrecv(chunks[(r - s + 1) % p], (r + 1) % p, (r - 1) % p)
    return np.concatenate(chunks)


def _ring_leftwards(comm, x):  # the ring run the other way round: send to r-1, receive from r+1
    p, r = comm.size, comm.rank
    chunks = [c.copy() for c in np.array_split(x, p)]
    for s in range(p - 1):
        chunks[(r + s + 2) % p] += comm.sendrecv(chunks[(r + s + 1) % p], (r - 1) % p, (r + 1) % p)
    for s in range(p - 1):
        chunks[(r + s + 1) % p] = comm.sendrecv(chunks[(r + s) % p], (r - 1) % p, (r + 1) % p)
    return np.concatenate(chunks)


ACCEPTED = {"ring_all_reduce": [_ring_next_chunk, _ring_leftwards], "tree_broadcast": [_tree_broadcast]}
