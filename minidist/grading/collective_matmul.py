"""Grader for exercises/collective_matmul.py: the all-gather matmul and the matmul reduce-scatter of
collective matmul, on point-to-point messages.

``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. Each runs on 1..4 ranks
of the rendezvous transport (a send completes only when its receive is posted, as MPI's large
messages: a ring of blocking send-then-receive fails, naming the deadlock), compares with the
collective written out (concatenate, then multiply; multiply, sum, then slice), reads the ledger
(exactly p-1 messages of one chunk per rank, no collective call) and the order of events: every
transfer must be started before the multiply beside it and waited for after it (overlap.py).
They run here against minidist's own ring steps (``reference``: must pass) and the broken
versions in ``BROKEN`` (must fail); ``python -m minidist.grade collective_matmul`` runs them on a
student's file.
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.autograd.tensor import Tensor
from minidist.comm import all_gather, measure
from minidist.grading import assert_close, no_hang, run_guarded, untouched
from minidist.grading.overlap import EventComm, logged, logging, unhidden
from minidist.parallel.tensor.collective_matmul import all_gather_matmul as _ag_mm
from minidist.parallel.tensor.collective_matmul import matmul_reduce_scatter as _mm_rs

GRADE = settings(max_examples=15, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
TOL = dict(rtol=1e-10, atol=1e-12)  # the same products; BLAS may order a block's sums differently
WAIT_S = 10  # a rank waiting longer than this for its peers fails the task


@st.composite
def problems(draw):
    """tp, every rank's x, and w: x_r (B, t, k) chunks of a sequence, w (k, n)."""
    tp = draw(st.integers(1, 4))
    b, t, k, n = (draw(st.integers(1, 3)) for _ in range(4))
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    return tp, rng.standard_normal((tp, b, t, k)), rng.standard_normal((k, n)), rng


def _on_ranks(tp, fn):
    """fn(comm) on tp rendezvous ranks: [(result, messages, bytes sent, collective calls, events)] by
    rank (events: overlap.py's log of transfers and multiplies)."""
    @logging
    def body(comm):
        with measure(comm) as m:
            out = fn(comm)
        return np.asarray(out), m.messages, m.bytes_sent, [c.name for c in m.calls]
    return [(*res, events) for res, events in run_guarded(body, tp, WAIT_S, comm_class=EventComm)]


def _traffic(what, tp, msgs, sent, calls, chunk_bytes, events):
    assert not calls, f"{what}: called the collectives {calls}; use point-to-point messages only"
    assert msgs == tp - 1 and sent == (tp - 1) * chunk_bytes, (
        f"{what}: sent {msgs} messages, {sent} bytes; the ring sends p-1 = {tp - 1} of one chunk "
        f"({chunk_bytes} bytes) each")
    late = unhidden(events)
    assert not late, (
        f"{what}: the {late[0]} finished before any multiply started beside it ({len(late)} such "
        f"transfers): nothing was hidden. Start each hop with comm.isend / comm.irecv, multiply the "
        f"chunk in hand, then wait for the hop")


def check_all_gather_matmul(impl):
    @GRADE
    @given(problem=problems())
    @example(problem=(2, np.ones((2, 1, 1, 1)), np.ones((1, 1)), None))
    def prop(problem):
        tp, xs, w, _ = problem
        want = np.concatenate(list(xs), axis=1) @ w
        ag_mm = untouched(impl.all_gather_matmul, ["comm", "x", "w"])
        out = _on_ranks(tp, lambda c: ag_mm(c, logged(xs[c.rank].copy()), logged(w)))
        for r, (y, msgs, sent, calls, events) in enumerate(out):
            what = f"rank {r} of p={tp}, x chunks {xs.shape[1:]}, w {w.shape}"
            assert_close(y, want, f"{what}, compared with concatenate(x chunks, axis=1) @ w", **TOL)
            _traffic(what, tp, msgs, sent, calls, xs[r].nbytes, events)
    no_hang(prop)


def check_matmul_reduce_scatter(impl):
    @GRADE
    @given(problem=problems())
    @example(problem=(2, np.ones((2, 1, 2, 1)), np.ones((1, 1)), None))
    def prop(problem):
        tp, xs, w, rng = problem
        if rng is not None:  # every rank's features of a whole sequence of T = p·t tokens
            xs = rng.standard_normal((tp, xs.shape[1], tp * xs.shape[2], xs.shape[3]))
        ws = w[None] * (1.0 + np.arange(tp))[:, None, None]  # every rank its own w (its rows of W)
        total = sum(xs[r] @ ws[r] for r in range(tp))
        t = xs.shape[2] // tp
        mm_rs = untouched(impl.matmul_reduce_scatter, ["comm", "x", "w"])
        out = _on_ranks(tp, lambda c: mm_rs(c, logged(xs[c.rank].copy()), logged(ws[c.rank].copy())))
        for r, (y, msgs, sent, calls, events) in enumerate(out):
            what = f"rank {r} of p={tp}, x {xs.shape[1:]}, w {w.shape}"
            assert_close(y, total[:, r * t:(r + 1) * t], f"{what}, compared with chunk {r} of Σ x @ w", **TOL)
            _traffic(what, tp, msgs, sent, calls, total[:, :t].nbytes, events)
    no_hang(prop)


CHECKS = {"all_gather_matmul": check_all_gather_matmul, "matmul_reduce_scatter": check_matmul_reduce_scatter}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def reference():
    return types.SimpleNamespace(
        all_gather_matmul=lambda comm, x, w: _ag_mm(Tensor(x), Tensor(w), None, comm).data,
        matmul_reduce_scatter=lambda comm, x, w: _mm_rs(Tensor(x), Tensor(w), comm).data)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _with_all_gather(comm, x, w):  # right numbers, but the blocking collective it should replace
    return all_gather(comm, x, axis=1) @ w


def _wrong_direction(comm, x, w):  # passes chunks left but files them as if they came from the right
    r, p = comm.rank, comm.size
    out, held = [None] * p, x
    for s in range(p):
        out[(r + s) % p] = held @ w
        if s < p - 1:
            held = comm.sendrecv(held, (r + 1) % p, (r - 1) % p)
    return np.concatenate(out, axis=1)


def _own_part_only(comm, x, w):  # forgets the other ranks' partial sums
    t = x.shape[1] // comm.size
    return (x @ w)[:, comm.rank * t:(comm.rank + 1) * t]


def _off_by_one_chunk(comm, x, w):  # starts the ring at its own chunk: ends holding chunk rank+1
    r, p = comm.rank, comm.size
    t = x.shape[1] // p
    acc = None
    for s in range(p):
        c = (r - s) % p
        part = x[:, c * t:(c + 1) * t] @ w
        acc = part if acc is None else part + acc
        if s < p - 1:
            acc = comm.sendrecv(acc, (r + 1) % p, (r - 1) % p)
    return acc


def _recv_into_x(comm, x, w):  # right numbers, hops hidden, but receives into the caller's x
    r, p = comm.rank, comm.size
    out, held = [None] * p, x
    for s in range(p):
        if s < p - 1:
            recv, send = comm.irecv((r - 1) % p), comm.isend(held.copy(), (r + 1) % p)
        out[(r - s) % p] = held @ w
        if s < p - 1:
            send.wait()
            held[...] = recv.wait()
    return np.concatenate(out, axis=1)


def _blocking_ring(comm, x, w):  # send, then receive: every rank waits in its send (MPI: a deadlock)
    r, p = comm.rank, comm.size
    out, held = [None] * p, x
    for s in range(p):
        out[(r - s) % p] = held @ w
        if s < p - 1:
            comm.send(held, (r + 1) % p)
            held = comm.recv((r - 1) % p)
    return np.concatenate(out, axis=1)


def _wait_then_multiply(comm, x, w):  # right numbers and bytes, but each hop done before its multiply
    r, p = comm.rank, comm.size
    out, held = [None] * p, x
    for s in range(p):
        if s < p - 1:
            recv = comm.irecv((r - 1) % p)
            comm.isend(held, (r + 1) % p).wait()
            nxt = recv.wait()
        out[(r - s) % p] = held @ w
        if s < p - 1:
            held = nxt
    return np.concatenate(out, axis=1)


def _sendrecv_sum(comm, x, w):  # the running sum exchanged with a blocking sendrecv: nothing hidden
    r, p = comm.rank, comm.size
    t = x.shape[1] // p
    acc = None
    for s in range(p):
        c = (r - s - 1) % p
        part = x[:, c * t:(c + 1) * t] @ w
        acc = part if acc is None else part + acc
        if s < p - 1:
            acc = comm.sendrecv(acc, (r + 1) % p, (r - 1) % p)
    return acc


BROKEN = {"all_gather_matmul": [_with_all_gather, _wrong_direction, _recv_into_x, _blocking_ring,
                                _wait_then_multiply],
          "matmul_reduce_scatter": [_own_part_only, _off_by_one_chunk, _sendrecv_sum]}
