"""Heartbeats (``minidist.resilience.heartbeat``): which ranks are stale, and which one is blamed,
against beats and times written out by hand."""

from minidist.resilience.heartbeat import STARTED, blame, stale_ranks


def test_a_rank_is_stale_only_past_the_timeout_and_one_that_never_beat_counts_from_the_first_beat():
    """Written out: rank 0 beat at t=10, rank 1 at t=12, rank 2 never (counted from 10). At now=15 with a
    5 s timeout rank 0 has been silent exactly 5 s -- not more -- so nothing is stale; at 15.5 ranks 0 and
    2 are (5.5 s), rank 1 is not (3.5 s)."""
    beats = {0: (3, 10.0), 1: (4, 12.0)}
    assert stale_ranks(beats, 3, 15.0, 5.0) == {}
    assert stale_ranks(beats, 3, 15.5, 5.0) == {0: 5.5, 2: 5.5}
    assert stale_ranks({}, 3, 100.0, 5.0) == {}


def test_blame_names_the_rank_that_got_least_far_then_the_one_silent_longest():
    # rank 2 never beat: it is behind every rank that did
    assert blame({0: (5, 1.0), 1: (5, 2.0)}, {0: 9.0, 1: 8.0, 2: 9.0}) == 2
    # all at step 5: the one silent longest (rank 1, 9 s) stopped first
    assert blame({0: (5, 2.0), 1: (5, 1.0), 2: (5, 2.0)}, {0: 8.0, 1: 9.0, 2: 8.0}) == 1
    # a lower step wins over a longer silence
    assert blame({0: (4, 3.0), 1: (5, 1.0)}, {0: 7.0, 1: 9.0}) == 0
    assert blame({0: (STARTED, 1.0), 1: (0, 1.0)}, {0: 1.0, 1: 9.0}) == 0
