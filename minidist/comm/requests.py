"""What a pending message is, and the errors a communication raises.

A transport's ``isend_buffer`` / ``irecv_buffer`` return a ``Request``: ``test()`` (done yet?),
``wait()`` (the received array, None for a send) and ``problem()`` (why it may never complete).
Every failure is a ``CommError`` naming the ranks involved: the watchdog's ``CommTimeout``, a failed
rank's ``RankAborted``, a departed peer's ``RankExited``, a wrong-sized message's ``MessageMismatch``.
"""

from __future__ import annotations

import os

DEFAULT_TIMEOUT = 300.0         # seconds a wait may take; MINIDIST_TIMEOUT overrides


def default_timeout() -> float:
    """``MINIDIST_TIMEOUT`` seconds (default 300): how long the watchdog lets any wait take."""
    return float(os.environ.get("MINIDIST_TIMEOUT", DEFAULT_TIMEOUT))


class CommError(RuntimeError):
    """A communication failure that names the ranks involved."""


class CommTimeout(CommError, TimeoutError):
    """A wait ran past ``comm.timeout``: the watchdog's error."""


class RankAborted(CommError):
    """Raised on the other ranks when one rank failed (threads transport), so nobody hangs."""


class RankExited(CommError):
    """The peer this rank waits for has already returned from its function: it will never send."""


class MessageMismatch(CommError, ValueError):
    """A message arrived with another size or dtype than the receiver's buffer."""


class Request:
    """A pending send or receive. ``wait()`` returns the received array (None for a send).
    ``problem()``: why it may never complete (a failed, departed or mismatched peer), or None --
    what a wait on several requests (``collectives.wait_all``) checks while it sleeps."""

    def test(self) -> bool:
        raise NotImplementedError

    def wait(self):
        raise NotImplementedError

    def problem(self):
        return None


class Converted(Request):
    """Wraps a host-buffer request so ``wait()`` returns an array of the caller's backend."""

    def __init__(self, req: Request, convert):
        self._req, self._convert, self._done, self._value = req, convert, False, None

    def test(self) -> bool:
        return self._req.test()

    def problem(self):
        return self._req.problem()

    def wait(self):
        if not self._done:
            self._value = self._convert(self._req.wait())
            self._done = True
        return self._value
