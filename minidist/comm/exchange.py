"""All-to-all, gather and scatter: the collectives that move different data to each rank.

``all_to_all`` sends ``chunks[j]`` to rank j in p-1 rounds (round s: to rank r+s, from rank r-s):
expert parallelism's dispatch and Ulysses' head/sequence swap. ``gather`` and ``scatter`` go
through one root, one message per other rank. Shapes and dtypes may differ between ranks: each
message carries a small header.
"""

from __future__ import annotations

import numpy as np

from minidist.comm.call import collective, result_backend


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
            k.step()
        return [be.from_host(o) for o in out]


def gather(comm, x, root: int = 0) -> list | None:
    """Every rank's x, as a list on ``root`` (shapes may differ); None elsewhere."""
    root = comm.check_peer(root, "root")
    with collective(comm, "gather", root=root) as k:   # shapes and dtypes may differ: x not in the stamp
        c, be = k.comm, result_backend(comm, x)
        h = np.ascontiguousarray(be.to_host(x))
        k.step(c.size - 1)
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
        k.step(c.size - 1)
        if c.rank == root:
            be = result_backend(comm, chunks[root])
            for r in range(c.size):
                if r != root:
                    c.send_buffer(np.ascontiguousarray(be.to_host(chunks[r])), r, k.tag, header=True)
            return be.from_host(np.array(be.to_host(chunks[root]), copy=True))
        return comm.backend.from_host(c.recv_buffer(None, root, k.tag, header=True))
