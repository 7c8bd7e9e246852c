"""How the MPI transport's messages look on the wire: the header, the bytes, the size checks.

A message with a header is two MPI messages: a small int64 header (``encode_header``: ndim, dtype
name, shape; ``HEADER_LEN`` words) and the payload. The payload is the NumPy buffer itself when
mpi4py maps its dtype to an MPI type (``mpi_knows``), else its bytes (bfloat16). Every receive
checks the size of what arrived, so a mismatch is a ``MessageMismatch`` naming both sizes, not
garbage. mpi4py is imported on first use (``_mpi``). Re-exported by
``minidist.comm.transports.mpi``.
"""

from __future__ import annotations

import numpy as np

from minidist.comm.requests import MessageMismatch

MAX_NDIM = 32
HEADER_LEN = 4 + MAX_NDIM      # ndim, 3 words of dtype name (24 chars), shape

_MPI = None


def _mpi():
    global _MPI
    if _MPI is None:
        from mpi4py import MPI

        _MPI = MPI
    return _MPI


def encode_header(buf: np.ndarray) -> np.ndarray:
    name = buf.dtype.name.encode()
    if buf.ndim > MAX_NDIM or len(name) > 24:
        raise ValueError(f"cannot send {buf.dtype}{list(buf.shape)}: at most {MAX_NDIM} dims")
    h = np.zeros(HEADER_LEN, np.int64)
    h[0] = buf.ndim
    h[1:4] = np.frombuffer(name.ljust(24, b"\0"), np.int64)
    h[4:4 + buf.ndim] = buf.shape
    return h


def decode_header(h: np.ndarray):
    name = h[1:4].tobytes().rstrip(b"\0").decode()
    try:
        dtype = np.dtype(name)
    except TypeError:
        import ml_dtypes

        dtype = np.dtype(getattr(ml_dtypes, name))
    return tuple(int(s) for s in h[4:4 + int(h[0])]), dtype


_NATIVE = set("?bBhHiIlLqQefdgFDG")  # dtypes mpi4py maps to MPI types itself


_KNOWN: dict = {}  # dtype -> mpi_knows(dtype): asked for every message, answered once per dtype


def mpi_knows(dtype) -> bool:
    """Does mpi4py map this dtype to an MPI type (so MPI itself can reduce it)?"""
    known = _KNOWN.get(dtype)
    if known is None:
        d = np.dtype(dtype)
        known = _KNOWN[dtype] = d.char in _NATIVE and d.isnative
    return known


def _bytes(buf: np.ndarray):
    """The buffer as MPI sees it: the array itself for standard dtypes, else its bytes (bfloat16)."""
    if mpi_knows(buf.dtype):
        return buf
    return buf.reshape(-1).view(np.uint8)


def _truncated(comm, source, tag, nbytes, error) -> Exception:
    """MPI's truncation error (a message larger than the buffer), in words; other errors as they are."""
    MPI = _mpi()
    if error.Get_error_class() not in (MPI.ERR_TRUNCATE, MPI.ERR_IN_STATUS):
        return error
    return MessageMismatch(f"rank {comm.rank}: a message from rank {source} (tag {tag}) is larger than the "
                           f"{nbytes}-byte buffer posted for it: the ranks disagree on the size ({error})")


def _check_count(comm, status, source, tag, nbytes) -> None:
    got = status.Get_count(_mpi().BYTE)
    if got != nbytes:
        raise MessageMismatch(f"rank {comm.rank}: received {got} bytes from rank {source} (tag {tag}) into "
                              f"a buffer of {nbytes} bytes: the ranks disagree on the size")
