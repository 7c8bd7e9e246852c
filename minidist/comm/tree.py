"""Binomial trees and the naive root: reduce to a root, broadcast from it, and their all-reduce.

``tree_all_reduce`` is reduce + broadcast: at most 2N ceil(log2 p) bytes in 2 ceil(log2 p) rounds;
``naive_all_reduce`` sends everything through rank 0 (the baseline). Table: ``collectives.py``.
"""

from __future__ import annotations

import numpy as np

from minidist.comm.call import OPS, collective, result_backend, scratch

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
    k.step(_rounds(p))


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
    k.step(_rounds(p))
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
        k.step(2 * (c.size - 1))
        return k.result(buf)


