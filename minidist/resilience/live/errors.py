"""The named errors of live recovery: each says what happened and what to do next."""

from __future__ import annotations

from minidist.comm.requests import CommError, RankExited


class LiveError(RuntimeError):
    """A live-recovery job cannot go on without help."""


class LastGroupLost(LiveError):
    """Every replica group has failed: no live peer holds the state. ``step`` is the step that was
    running; ``checkpoint`` the newest checkpoint step to restart from (None: none was saved)."""

    def __init__(self, message: str, step: int, checkpoint: int | None):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint


class NoLivePeer(LiveError):
    """A replacement could not reach any live peer to heal from."""


class HealFailed(LiveError):
    """A heal did not complete (the donor failed part-way, or the state did not fit this replica)."""


class Revoked(CommError):
    """An operation on a communicator the coordinator revoked (ULFM's ``MPIX_Comm_revoke``): a member
    of it failed, and every pending and later operation on it raises this instead of waiting."""


class GroupLeft(BaseException):
    """This member's replica group left the quorum (a member of it failed): the member ends. A
    BaseException so that no ``except Exception`` in a training step swallows it."""


class Unreachable(RankExited):
    """A peer could not be reached (its address refused the connection, or the link to it broke)."""
