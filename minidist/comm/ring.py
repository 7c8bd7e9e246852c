"""The ring: reduce-scatter then all-gather, each p-1 steps of one chunk to the next rank.

Bandwidth-optimal: every rank sends 2(p-1)/p of the array in all (exactly 2N - |c_r| - |c_{r+1}| bytes
with ``c = np.array_split(x.ravel(), p)``). ``ring_all_reduce``, ``reduce_scatter`` and ``all_gather``
are the three collectives; the chunk helpers are shared with two-shot and tensor parallelism.
The table of every algorithm's bytes and steps is in ``collectives.py``.
"""

from __future__ import annotations

import numpy as np

from minidist.comm.call import OPS, collective, scratch


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
        k.step()


def ring_all_gather_chunks(k, chunks: list[np.ndarray]) -> None:
    """In place: rank r owns chunk r; after p-1 steps of pass-to-the-right every rank has all."""
    c = k.comm
    r, p = c.rank, c.size
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send_i, recv_i = ring_chunks(r, p, s, "all-gather")
        c.sendrecv_buffer(chunks[send_i], right, chunks[recv_i], left, k.tag)
        k.step()


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
            k.step()
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


