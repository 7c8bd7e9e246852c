"""A supervised job's attempts (``minidist.resilience.attempts``): the ranks of an elastic restart and
the steps each restart recomputed, against values worked out by hand."""

import pytest

from minidist.resilience.attempts import Attempt, elastic_size, recomputed

# the original size, the ranks that survive -> the ranks an elastic restart uses (the largest divisor
# of the original size that fits), by hand
ELASTIC = [(8, 7, 4), (8, 6, 4), (8, 4, 4), (8, 3, 2), (8, 1, 1), (6, 5, 3), (6, 2, 2), (12, 11, 6),
           (12, 9, 6), (12, 5, 4), (7, 6, 1), (4, 4, 4), (9, 8, 3)]


@pytest.mark.parametrize("n,left,want", ELASTIC)
def test_elastic_restart_takes_the_largest_divisor_that_fits(n, left, want):
    assert elastic_size(n, left) == want


def test_steps_recomputed_count_each_attempt_against_where_the_next_resumed():
    """Attempt 0 reached step 7 and attempt 1 resumed from 4: 3 steps redone; attempt 1 reached 9, attempt 2
    resumed from 8: 1; attempt 2 finished (nothing after it). An attempt that died before its first step
    (None) redid nothing; one resumed from no checkpoint (None) redid everything."""
    a = [Attempt(0, 4, 0.0, last_step=7), Attempt(1, 4, 0.0, resumed_from=4, last_step=9),
         Attempt(2, 4, 0.0, resumed_from=8, last_step=12)]
    assert recomputed(a) == [3, 1, None]
    b = [Attempt(0, 4, 0.0, last_step=None), Attempt(1, 4, 0.0, resumed_from=None, last_step=5),
         Attempt(2, 2, 0.0, resumed_from=None, last_step=6)]
    assert recomputed(b) == [None, 5, None]


@pytest.mark.parametrize("n,left", [(4, 0), (1, 0)])
def test_no_rank_left_is_zero_ranks_not_an_error(n, left):
    assert elastic_size(n, left) == 0


@pytest.mark.parametrize("written_by,job,resumed", [("A", "A", 7), ("A", None, 7), (None, None, 7),
                                                    ("A", "B", None), (None, "B", None)])
def test_a_restart_resumes_only_its_own_jobs_checkpoint(monkeypatch, written_by, job, resumed):
    """One intact step-7 checkpoint (stand-ins for the file reads), written by ``written_by``: a restart of
    ``job`` resumes from it only if the jobs agree (``job`` None: any job's); a checkpoint that names no job
    is not this named job's."""
    from minidist.resilience import attempts

    monkeypatch.setattr(attempts.files, "candidates", lambda root: (["/c/step-00000007"], []))
    monkeypatch.setattr(attempts.files, "read_manifest", lambda d: {"step": 7, "job": written_by,
                                                                    "files": {"rank-00000.bin": {}}})
    monkeypatch.setattr(attempts.files, "check_file", lambda d, n, meta: None)
    step, problems = attempts.newest_good_checkpoint("/c", job)
    assert step == resumed
    why = f"step-00000007: written by job {written_by!r}, not this job {job!r}"
    assert problems == ([] if resumed else [why])
