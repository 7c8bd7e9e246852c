"""Collectives built from point-to-point messages: each one a short function a lesson can show.

Every function is SPMD code for one rank: call it on every rank of ``comm`` with that rank's
array. Arrays of any backend come in; the algorithm runs on NumPy host buffers (what transports
move) and the result goes back in the caller's backend. Results are new arrays (functional).

=====================================  =============================  ====================
collective                             bytes sent per rank (N bytes)  steps (rounds)
=====================================  =============================  ====================
ring_all_reduce                        2(p-1)/p N  [1]                2(p-1)
recursive_doubling_all_reduce          N log2 p  (p a power of 2)     log2 p (+2 if not)
halving_doubling_all_reduce            2(p-1)/p N  (p a power of 2)   2 log2 p (+2 if not)
tree_all_reduce (reduce + broadcast)   <= 2 N ceil(log2 p)            2 ceil(log2 p)
naive_all_reduce (gather + broadcast)  root (p-1) N, others N         2(p-1)
shm_all_reduce (one node, no messages) N into shared memory [3]       1 per piece (two-shot 2)
reduce_scatter (ring)                  (p-1)/p N  [2]                 p-1
all_gather (ring)                      (p-1)/p N  (N = output size)   p-1
=====================================  =============================  ====================

[1] exactly ``2N - |c_r| - |c_{r+1}|`` with ``c = np.array_split(x.ravel(), p)`` in bytes: rank r
    sends every chunk but its own in reduce-scatter and every chunk but ``r+1`` in all-gather.
[2] exactly ``N - |c_r|``.
[3] two-shot also writes its reduced chunk: ``N + |c_r|`` per piece; bytes received = bytes read from
    the other ranks' buffers; one message per call (shm.py).

Each algorithm opens its call with ``with collective(comm, name, x, op=op) as k`` (call.py): the
host staging, the op check, the ledger record, the stamp and debug mode's check live there, so the
body is only the algorithm: messages on ``k.comm`` (the communicator's strict private channel, which
never matches a user's point-to-point messages) under the call's stamp ``k.tag``, through the
Communicator's public interface (``sendrecv_buffer``, ``send_buffer``, ``recv_buffer``, ...).
"""

from __future__ import annotations

import numpy as np

from minidist.comm.call import OPS, check_op, collective, result_backend, scratch, unwatched
from minidist.comm.communicator import poll
from minidist.comm.cost import agreed_crowded, choose_algorithm, shm_wins
from minidist.comm.debug import check_same_call
from minidist.comm.handles import start_async
from minidist.comm.transports.mpi import mpi_knows
from minidist.comm.transports.shm import shm_lane

ALGORITHMS = ("auto", "ring", "recursive_doubling", "halving_doubling", "two_shot", "tree", "naive", "mpi",
              "shm")


def split_sizes(n: int, p: int) -> list[int]:
    """The lengths of ``np.array_split(range(n), p)``: the first ``n % p`` parts one longer."""
    q, extra = divmod(n, p)
    return [q + 1] * extra + [q] * (p - extra)


# -- ring: reduce-scatter then all-gather (bandwidth optimal) -------------------------------------

def ring_chunks(rank: int, p: int, step: int, phase: str) -> tuple[int, int]:
    """(chunk sent to the right, chunk received from the left) by ``rank`` at ``step`` of a ring phase.

    reduce-scatter: send r-s-1, receive r-s-2 (and reduce it): rank r ends owning chunk r.
    all-gather:     send r-s,   receive r-s-1 (and keep it):   everyone ends with every chunk.
    """
    shift = 1 if phase == "reduce-scatter" else 0
    return (rank - step - shift) % p, (rank - step - shift - 1) % p


def ring_reduce_scatter_chunks(k, chunks: list[np.ndarray], op: str, src=None) -> None:
    """On flat contiguous ``chunks`` (one per rank): afterwards chunk ``rank`` is fully reduced.

    Step s: send chunk (r-s-1) to the right neighbour, receive chunk (r-s-2) from the left one
    and combine it with our own. After p-1 steps chunk r has passed every rank once.
    ``src``: this rank's own data, if not already in ``chunks`` (saves copying the input).
    """
    c = k.comm
    r, p = c.rank, c.size
    right, left = (r + 1) % p, (r - 1) % p
    src = chunks if src is None else src
    tmp = scratch(c, max(ch.size for ch in chunks), chunks[0].dtype)
    for s in range(p - 1):
        send_i, recv_i = ring_chunks(r, p, s, "reduce-scatter")
        incoming = tmp[:chunks[recv_i].size]
        c.sendrecv_buffer((src if s == 0 else chunks)[send_i], right, incoming, left, k.tag)
        OPS[op](src[recv_i], incoming, out=chunks[recv_i])
        k.rec.step()


def ring_all_gather_chunks(k, chunks: list[np.ndarray]) -> None:
    """In place: rank r owns chunk r; after p-1 steps of pass-to-the-right every rank has all."""
    c = k.comm
    r, p = c.rank, c.size
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send_i, recv_i = ring_chunks(r, p, s, "all-gather")
        c.sendrecv_buffer(chunks[send_i], right, chunks[recv_i], left, k.tag)
        k.rec.step()


def ring_all_reduce(comm, x, op: str = "sum"):
    """Ring all-reduce: reduce-scatter, then all-gather, over ``np.array_split`` chunks of x."""
    with collective(comm, "ring_all_reduce", x, op=op) as k:
        out = np.empty_like(k.flat)  # the result: chunks are reduced straight from the input into it
        if comm.size == 1:
            out[...] = k.flat
        else:
            chunks = np.array_split(out, comm.size)
            ring_reduce_scatter_chunks(k, chunks, op, src=np.array_split(k.flat, comm.size))
            ring_all_gather_chunks(k, chunks)
        return k.result(out)


def reduce_scatter(comm, x, op: str = "sum", axis: int = 0):
    """Split x along ``axis`` like ``np.array_split`` into p chunks; return this rank's chunk reduced
    over all ranks (ring, p-1 steps, sends ``N - |chunk_r|`` bytes)."""
    with collective(comm, "reduce_scatter", x, op=op, axis=axis) as k:
        front = np.array(np.moveaxis(k.host, axis, 0), order="C", copy=True)  # chunks become contiguous
        chunks = np.array_split(front, comm.size, axis=0)
        if comm.size > 1:
            ring_reduce_scatter_chunks(k, [ch.reshape(-1) for ch in chunks], op)
        mine = k.finish(chunks[comm.rank])
        return k.be.from_host(np.ascontiguousarray(np.moveaxis(mine, 0, axis)))


def all_gather(comm, x, axis: int = 0, sizes=None):
    """Concatenate every rank's x along ``axis``: ring, p-1 steps, (p-1)/p·N bytes sent per rank
    (N = the output's bytes; exactly N - |part r+1|).

    ``sizes``: what every rank knows about the parts' lengths along ``axis``.
    None: they may differ and nobody knows them -- each message carries a small shape header.
    ``"equal"``: every rank's x has the same shape. A list: rank j's length along ``axis`` is
    ``sizes[j]``. With sizes known, the parts are received straight into the output (no headers).
    """
    def shape_key(shape):  # every rank's shape must agree except along `axis`
        return shape[:axis % len(shape)] + shape[axis % len(shape) + 1:] if shape else shape

    if sizes is not None:
        return _all_gather_known(comm, x, axis, sizes)
    with collective(comm, "all_gather", x, shape_key=shape_key, axis=axis) as k:
        c, parts = k.comm, [None] * comm.size
        r, p = c.rank, c.size
        parts[r] = np.atleast_1d(k.host)
        for s in range(p - 1):
            send_i, recv_i = ring_chunks(r, p, s, "all-gather")
            parts[recv_i] = c.sendrecv_buffer(parts[send_i], (r + 1) % p, None, (r - 1) % p, k.tag,
                                              header=True)
            k.rec.step()
        return k.be.from_host(np.concatenate(parts, axis=axis))


def _all_gather_known(comm, x, axis, sizes):
    """all_gather when every rank knows every part's length: a header-free ring into the output."""
    shape = tuple(np.shape(x))
    if not shape:
        raise ValueError(f"rank {comm.rank}: all_gather needs an array with at least one axis, got a scalar")
    axis = axis % len(shape)
    if isinstance(sizes, str):
        if sizes != "equal":
            raise ValueError(f"rank {comm.rank}: all_gather sizes={sizes!r}; use None, 'equal' or a list "
                             f"of {comm.size} lengths along axis {axis}")
        sizes = [shape[axis]] * comm.size
    sizes = [int(n) for n in sizes]
    if len(sizes) != comm.size or sizes[comm.rank] != shape[axis]:
        raise ValueError(f"rank {comm.rank}: all_gather sizes={sizes} must list {comm.size} lengths "
                         f"along axis {axis}, with entry {comm.rank} = this rank's {shape[axis]} "
                         f"(x has shape {shape})")
    rest = shape[:axis] + shape[axis + 1:]
    sig = {"shape_key": lambda s: rest, "axis": axis, "sizes": tuple(sizes)}
    with collective(comm, "all_gather", x, **sig) as k:
        front = np.moveaxis(k.host, axis, 0)                  # parts become contiguous blocks of out
        out = np.empty((sum(sizes),) + front.shape[1:], front.dtype)
        bounds = np.cumsum([0] + sizes)
        out[bounds[comm.rank]:bounds[comm.rank + 1]] = front
        if comm.size > 1:
            flat = out.reshape(-1)
            n = int(np.prod(front.shape[1:], dtype=np.int64))
            ring_all_gather_chunks(k, [flat[a * n:b * n] for a, b in zip(bounds[:-1], bounds[1:])])
        return k.be.from_host(np.ascontiguousarray(np.moveaxis(out, 0, axis)) if axis else out)


# -- recursive doubling (latency optimal: log2 p steps, any p) ------------------------------------

def recursive_doubling_all_reduce(comm, x, op: str = "sum"):
    """Partners at distance 1, 2, 4, ... swap whole arrays and combine: log2 p steps.

    For p not a power of two, the first 2*rem ranks (rem = p - 2**floor(log2 p)) pair up first:
    even ranks hand their array to the odd neighbour and sit out, getting the result at the end.
    """
    with collective(comm, "recursive_doubling_all_reduce", x, op=op) as k:
        c, buf = k.comm, k.flat.copy()
        r, p, fn = c.rank, c.size, OPS[op]
        pof2 = 1 << (p.bit_length() - 1)
        rem, tmp, rounds = p - pof2, scratch(c, buf.size, buf.dtype), pof2.bit_length() - 1
        vrank = _fold_in(k, buf, tmp, fn, rem)
        if vrank >= 0:
            mask = 1
            while mask < pof2:
                peer = _real_rank(vrank ^ mask, rem)
                c.sendrecv_buffer(buf, peer, tmp, peer, k.tag)
                fn(tmp, buf, out=buf) if peer < r else fn(buf, tmp, out=buf)  # lower rank first
                mask <<= 1
        _fold_out(k, buf, rem)
        k.rec.step(rounds + (2 if rem else 0))  # rounds of the algorithm (idle ones included)
        return k.result(buf)


# -- two-shot: the ring's bytes in 2 rounds ------------------------------------------------------

def wait_all(c, requests: list, what: str) -> None:
    """Wait for every request together (testing all of them each time, so all make progress);
    while waiting, a request's ``problem()`` (a failed, departed or mismatched peer) is raised."""
    def problem():
        return next((e for q in requests if not q.test() and (e := q.problem()) is not None), None)
    poll(lambda: all([q.test() for q in requests]), c, what, problem)
    for q in requests:
        q.wait()


def two_shot_all_reduce(comm, x, op: str = "sum"):
    """Reduce-scatter, then all-gather, each in ONE round of p-1 messages in flight at once.

    Round 1: rank r sends chunk j of its x to rank j (for every j != r) and receives chunk r from
    everyone, then reduces them in rank order. Round 2: it sends its reduced chunk to everyone and
    receives theirs. Bytes as the ring, 2(p-1)/p·N, in 2 rounds instead of 2(p-1) steps: no rank
    waits for a neighbour that waits for its own -- what costs most when ranks outnumber cores.
    The price is p-1 messages per round instead of one.
    """
    with collective(comm, "two_shot_all_reduce", x, op=op) as k:
        c, src = k.comm, k.flat
        p, r, fn = c.size, c.rank, OPS[op]
        bounds = np.cumsum([0] + split_sizes(src.size, p))
        part = [slice(bounds[j], bounds[j + 1]) for j in range(p)]
        out = np.empty_like(src)
        n = bounds[r + 1] - bounds[r]
        incoming = scratch(c, p * n, src.dtype).reshape(p, n)
        peers = [j for j in range(p) if j != r]
        reqs = [c.irecv_buffer(incoming[j], j, k.tag) for j in peers]
        reqs += [c.isend_buffer(src[part[j]], j, k.tag) for j in peers]
        wait_all(c, reqs, "two-shot reduce-scatter")
        incoming[r] = src[part[r]]
        out[part[r]] = incoming[0]
        for j in range(1, p):                    # in rank order: every rank's chunk adds up alike
            fn(out[part[r]], incoming[j], out=out[part[r]])
        k.finish(out[part[r]])
        reqs = [c.irecv_buffer(out[part[j]], j, k.tag + 1) for j in peers]   # round 2: phase bit
        reqs += [c.isend_buffer(out[part[r]], j, k.tag + 1) for j in peers]
        wait_all(c, reqs, "two-shot all-gather")
        k.rec.step(2 if p > 1 else 0)           # p = 1: nothing to exchange, no rounds
        return k.be.from_host(out.reshape(np.shape(x)))


# -- halving-doubling (Rabenseifner): the ring's bytes in 2 log2 p steps ---------------------------

def halving_doubling_all_reduce(comm, x, op: str = "sum"):
    """Reduce-scatter by recursive halving, then all-gather by recursive doubling.

    Step k of the first half: swap half of the part you still own with the partner 2**k away
    (farthest first) and reduce the half you keep; after log2 p steps you own one chunk, fully
    reduced. The second half retraces the steps, doubling what you own. Bytes as the ring,
    2(p-1)/p N for p a power of two, but in 2 log2 p steps instead of 2(p-1): better when latency
    (or a crowded CPU) dominates. Other p: the extra ranks fold in first, as in recursive doubling.
    """
    with collective(comm, "halving_doubling_all_reduce", x, op=op) as k:
        c, src = k.comm, k.flat
        p, fn = c.size, OPS[op]
        q = 1 << (p.bit_length() - 1)
        rem, logq = p - q, q.bit_length() - 1
        buf, tmp = np.empty_like(src), scratch(c, src.size, src.dtype)
        if c.rank < 2 * rem or q == 1:           # folding works in place: start from a copy
            buf[...] = src
            src = buf
        vrank = _fold_in(k, buf, tmp, fn, rem)

        if vrank >= 0:
            bounds = np.cumsum([0] + split_sizes(buf.size, q))
            lo, hi, mask = 0, q, q >> 1
            while mask:                          # reduce-scatter: halve what I own each step
                mid, peer = (lo + hi) // 2, _real_rank(vrank ^ mask, rem)
                low = not vrank & mask           # the lower partner keeps the lower half
                (klo, khi), (slo, shi) = ((lo, mid), (mid, hi)) if low else ((mid, hi), (lo, mid))
                keep, incoming = slice(bounds[klo], bounds[khi]), tmp[:bounds[khi] - bounds[klo]]
                c.sendrecv_buffer(src[bounds[slo]:bounds[shi]], peer, incoming, peer, k.tag)
                fn(src[keep], incoming, out=buf[keep])  # the first step reads the input: no copy of it
                lo, hi, mask, src = klo, khi, mask >> 1, buf
            mask = 1
            while mask < q:                      # all-gather: double what I own each step
                width, peer = hi - lo, _real_rank(vrank ^ mask, rem)
                plo, phi = (hi, hi + width) if not vrank & mask else (lo - width, lo)
                c.sendrecv_buffer(buf[bounds[lo]:bounds[hi]], peer, buf[bounds[plo]:bounds[phi]], peer, k.tag)
                lo, hi, mask = min(lo, plo), max(hi, phi), mask << 1
        _fold_out(k, buf, rem)
        k.rec.step(2 * logq + (2 if rem else 0))
        return k.result(buf)


def _real_rank(v: int, rem: int) -> int:
    """The rank behind virtual rank ``v`` after the fold: of the first 2·rem ranks only the odd ones
    stay in (v < rem), the rest keep their order."""
    return 2 * v + 1 if v < rem else v + rem


def _fold_in(k, buf, tmp, fn, rem) -> int:
    """p not a power of two: even ranks below 2*rem hand their array to the odd neighbour and sit
    out (returns -1); the others get virtual ranks 0..q-1."""
    c = k.comm
    r = c.rank
    if r >= 2 * rem:
        return r - rem
    if r % 2 == 0:
        c.send_buffer(buf, r + 1, k.tag)
        return -1
    incoming = tmp[:buf.size]
    c.recv_buffer(incoming, r - 1, k.tag)
    fn(incoming, buf, out=buf)
    return r // 2


def _fold_out(k, buf, rem) -> None:
    """Hand the result back to the ranks that sat out."""
    c = k.comm
    r = c.rank
    if r < 2 * rem:
        if r % 2 == 1:
            c.send_buffer(buf, r - 1, k.tag)
        else:
            c.recv_buffer(buf, r + 1, k.tag)


# -- binomial trees: reduce to a root, broadcast from it ------------------------------------------

def _rounds(p: int) -> int:
    return (p - 1).bit_length()  # ceil(log2 p)


def tree_reduce_host(k, buf: np.ndarray, op: str, root: int) -> None:
    """Binomial tree, in place on ``buf``: in round k, ranks with bit k set (relative to root) send
    to the rank 2**k below and drop out. The root ends with the reduction."""
    c = k.comm
    p, vr = c.size, (c.rank - root) % c.size
    tmp, mask, fn = scratch(c, buf.size, buf.dtype).reshape(buf.shape), 1, OPS[op]
    while mask < p:
        if vr & mask:
            c.send_buffer(buf, (vr - mask + root) % p, k.tag)
            break
        if vr + mask < p:
            c.recv_buffer(tmp, (vr + mask + root) % p, k.tag)
            fn(buf, tmp, out=buf)
        mask <<= 1
    k.rec.step(_rounds(p))


def tree_broadcast_host(k, buf: np.ndarray | None, root: int, header: bool) -> np.ndarray:
    """Binomial tree: receive from the parent (lowest set bit of the relative rank), then send to
    the children 2**k above for every lower k. ``header``: receivers learn shape and dtype."""
    c = k.comm
    p, vr, mask = c.size, (c.rank - root) % c.size, 1
    while mask < p:
        if vr & mask:
            buf = c.recv_buffer(buf, (vr - mask + root) % p, k.tag, header=header)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < p:
            c.send_buffer(buf, (vr + mask + root) % p, k.tag, header=header)
        mask >>= 1
    k.rec.step(_rounds(p))
    return buf


def broadcast(comm, x, root: int = 0):
    """Root's x on every rank (binomial tree). Non-roots may pass None (they learn the shape) or
    an array of the right shape and dtype."""
    root = comm.check_peer(root, "root")
    if comm.rank == root and x is None:
        raise ValueError(f"rank {root}: broadcast root must pass an array, got None")
    with collective(comm, "broadcast", root=root) as k:
        be = comm.backend if x is None else result_backend(comm, x)
        h = None if x is None else np.ascontiguousarray(be.to_host(x))
        if h is not None and comm.rank != root:
            h = np.array(h, copy=True)
        return be.from_host(tree_broadcast_host(k, h, root, header=True))


def reduce(comm, x, op: str = "sum", root: int = 0):
    """The reduction of every rank's x, on ``root`` (binomial tree); None on the other ranks."""
    root = comm.check_peer(root, "root")
    with collective(comm, "reduce", x, op=op, root=root) as k:
        buf = k.host.copy()
        tree_reduce_host(k, buf.reshape(-1), op, root)
        return k.be.from_host(k.finish(buf)) if comm.rank == root else None


def tree_all_reduce(comm, x, op: str = "sum"):
    """Tree reduce to rank 0, then tree broadcast from it: 2 ceil(log2 p) steps."""
    with collective(comm, "tree_all_reduce", x, op=op) as k:
        buf = k.flat.copy()
        tree_reduce_host(k, buf, op, 0)
        tree_broadcast_host(k, buf, 0, header=False)
        return k.result(buf)


def naive_all_reduce(comm, x, op: str = "sum"):
    """Everyone sends to rank 0, which reduces in rank order and sends the result to everyone:
    the root moves (p-1) N bytes each way, one message at a time: 2(p-1) steps."""
    with collective(comm, "naive_all_reduce", x, op=op) as k:
        c, buf = k.comm, k.flat.copy()
        if c.rank == 0:
            tmp = scratch(c, buf.size, buf.dtype)
            for r in range(1, c.size):
                c.recv_buffer(tmp, r, k.tag)
                OPS[op](buf, tmp, out=buf)
            for r in range(1, c.size):
                c.send_buffer(buf, r, k.tag)
        elif c.size > 1:
            c.send_buffer(buf, 0, k.tag)
            c.recv_buffer(buf, 0, k.tag)
        k.rec.step(2 * (c.size - 1))
        return k.result(buf)


# -- MPI's own, as the reference to beat --------------------------------------------------------

def mpi_all_reduce(comm, x, op: str = "sum"):
    """MPI's own ``Allreduce`` (buffer API) under MPI; on other transports the ring all-reduce.

    Blocking inside MPI (no watchdog, no stamps: only debug mode compares the ranks' calls): it is
    the yardstick, not part of minidist's algorithms, so it runs with nothing added.
    """
    if comm.transport != "mpi":
        return ring_all_reduce(comm, x, op)
    from mpi4py import MPI

    with collective(comm, "mpi_all_reduce", x, op=op) as k:
        if not mpi_knows(k.host.dtype):
            raise TypeError(f"rank {comm.rank}: MPI's Allreduce can't reduce {k.host.dtype} (it doesn't know "
                            f"the type); use one of minidist's algorithms, e.g. algorithm='ring'")
        buf = k.host.copy()
        mop = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
        k.comm.mpi.Allreduce(MPI.IN_PLACE, buf, op=mop)
        return k.be.from_host(k.finish(buf))


# -- shared memory: ranks on one node read each other's buffers (shm.py) ----------------------------

def shm_all_reduce(comm, x, op: str = "sum"):
    """Through the node's shared memory, no messages (MPI transport, every rank on one node).

    Each rank copies x into its part of a shared window and posts the call; once every rank has
    posted, each adds up all ranks' buffers in rank order (one-shot), or, for large messages, its
    own chunk of them, which the others then copy (two-shot). Double buffering by call parity makes
    one wait per phase safe. Larger than the window: in pieces. shm.py explains the protocol.
    Elsewhere (threads, JAX devices, ranks on several nodes, an emulated slow link) this is the
    algorithm the cost model picks for ``auto``.
    """
    lane = getattr(comm, "shm", False)
    if lane is None:                             # MPI, first time: the window's handshake
        _check_before_handshake(comm, x, op, "shm")
        lane = shm_lane(comm)
    if not lane and comm.size > 1:
        return _BY_NAME[choose_algorithm(x.nbytes, comm.size, agreed_crowded(comm))](comm, x, op)
    if lane and type(x) is np.ndarray and unwatched(comm):  # (NumPy in, NumPy out, on any backend)
        return lane.call(comm, x, op)            # the same, with collective()'s work done leanly
    with collective(comm, "shm_all_reduce", x, op=op) as k:
        if not lane:
            return k.result(k.flat.copy())       # one rank: nothing to add
        out, sent, received, steps = lane.reduce(comm, k.tag, k.flat, op)
        comm.ledger.count_sendrecv(sent, received)
        k.rec.step(steps)
        return k.result(out)


_BY_NAME = {"ring": ring_all_reduce, "two_shot": two_shot_all_reduce,
            "recursive_doubling": recursive_doubling_all_reduce,
            "halving_doubling": halving_doubling_all_reduce, "tree": tree_all_reduce,
            "naive": naive_all_reduce, "mpi": mpi_all_reduce, "shm": shm_all_reduce}


def all_reduce(comm, x, op: str = "sum", algorithm: str = "auto"):
    """The reduction (sum/mean/max/min) of every rank's x, on every rank.

    ``algorithm="auto"``: on the MPI transport with every rank on one node and no emulated link,
    ``shm`` up to one window's piece, or at any size when ranks outnumber cores (``cost.shm_wins``);
    elsewhere (and for larger messages) the one the cost model
    predicts fastest for this size and group. Every rank gets the same answer (both are agreed
    once per communicator), so none waits for messages of another algorithm. In debug mode the
    ranks first compare their calls, before those agreements' handshakes."""
    if algorithm == "auto":
        lane = comm.shm if comm.transport == "mpi" else False
        if lane and (x.nbytes <= lane.cap or lane.crowded):  # the common case (cost.shm_wins), decided
            return shm_all_reduce(comm, x, op)
        if lane is None or comm.agreed_crowded is None:
            _check_before_handshake(comm, x, op, algorithm)
        if lane is None and shm_lane(comm) and shm_wins(x.nbytes, comm.shm.cap, comm.shm.crowded):
            return shm_all_reduce(comm, x, op)
        algorithm = choose_algorithm(x.nbytes, comm.size, agreed_crowded(comm))
    elif algorithm not in _BY_NAME:
        raise ValueError(f"rank {comm.rank}: unknown algorithm {algorithm!r}; use one of {ALGORITHMS}")
    return _BY_NAME[algorithm](comm, x, op)


def _check_before_handshake(comm, x, op, algorithm) -> None:
    """Debug mode: compare the ranks' calls before a handshake that a mismatch would hang."""
    if comm.debug and comm.size > 1:
        check_op(comm, op, x.dtype)
        check_same_call(comm, {"collective": "all_reduce", "seq": comm.seq + 1, "size": comm.size,
                               "shape": tuple(np.shape(x)), "dtype": str(x.dtype), "op": op,
                               "algorithm": algorithm})


# -- all-to-all, gather, scatter ----------------------------------------------------------------

def all_to_all(comm, chunks: list) -> list:
    """``chunks[j]`` goes to rank j; returns the list of what each rank sent to me (p-1 rounds:
    in round s send to rank r+s, receive from rank r-s)."""
    if len(chunks) != comm.size:
        raise ValueError(f"rank {comm.rank}: all_to_all needs {comm.size} chunks (one per rank), "
                         f"got {len(chunks)}")
    with collective(comm, "all_to_all") as k:
        c, be = k.comm, result_backend(comm, chunks[comm.rank])
        host = [np.ascontiguousarray(be.to_host(ch)) for ch in chunks]
        r, p = c.rank, c.size
        out = [None] * p
        out[r] = np.array(host[r], copy=True)
        for s in range(1, p):
            out[(r - s) % p] = c.sendrecv_buffer(host[(r + s) % p], (r + s) % p, None, (r - s) % p, k.tag,
                                                 header=True)
            k.rec.step()
        return [be.from_host(o) for o in out]


def gather(comm, x, root: int = 0) -> list | None:
    """Every rank's x, as a list on ``root`` (shapes may differ); None elsewhere."""
    root = comm.check_peer(root, "root")
    with collective(comm, "gather", root=root) as k:   # shapes and dtypes may differ: x not in the stamp
        c, be = k.comm, result_backend(comm, x)
        h = np.ascontiguousarray(be.to_host(x))
        k.rec.step(c.size - 1)
        if c.rank != root:
            c.send_buffer(h, root, k.tag, header=True)
            return None
        return [be.from_host(h.copy() if r == root else c.recv_buffer(None, r, k.tag, header=True))
                for r in range(c.size)]


def scatter(comm, chunks: list | None, root: int = 0):
    """``chunks[j]`` (given on root) to rank j; non-roots pass None."""
    root = comm.check_peer(root, "root")
    if comm.rank == root and (chunks is None or len(chunks) != comm.size):
        raise ValueError(f"rank {root}: scatter root needs {comm.size} chunks, got "
                         f"{None if chunks is None else len(chunks)}")
    with collective(comm, "scatter", root=root) as k:
        c = k.comm
        k.rec.step(c.size - 1)
        if c.rank == root:
            be = result_backend(comm, chunks[root])
            for r in range(c.size):
                if r != root:
                    c.send_buffer(np.ascontiguousarray(be.to_host(chunks[r])), r, k.tag, header=True)
            return be.from_host(np.array(be.to_host(chunks[root]), copy=True))
        return comm.backend.from_host(c.recv_buffer(None, root, k.tag, header=True))


# -- asynchronous versions ----------------------------------------------------------------------

def all_reduce_async(comm, x, op: str = "sum", algorithm: str = "auto"):
    """Start ``all_reduce`` in the background; ``.wait()`` on the returned Handle gives the result.
    Don't modify x before waiting (NumPy arrays are read by the worker thread)."""
    return start_async(comm, all_reduce, x, op=op, algorithm=algorithm)


def all_gather_async(comm, x, axis: int = 0, sizes=None):
    return start_async(comm, all_gather, x, axis=axis, sizes=sizes)


def reduce_scatter_async(comm, x, op: str = "sum", axis: int = 0):
    return start_async(comm, reduce_scatter, x, op=op, axis=axis)
