"""The checkpoint directory's helpers (``minidist.resilience.checkpoint.files``) by hand: which finished
steps and leftover temporary folders ``prune`` deletes, and which steps ``list_steps`` sees."""

import os

import pytest

from minidist.resilience.checkpoint.files import list_steps, prune


@pytest.mark.parametrize("names,keep,left", [
    # the newest finished step is 5: step-6.tmp (the next save, still being written) stays; 5.tmp goes
    (["step-00000005", "step-00000005.tmp", "step-00000006.tmp"], 3, ["step-00000005", "step-00000006.tmp"]),
    (["step-00000004", "step-00000005", "step-00000004.tmp"], 1, ["step-00000005"]),
    (["step-00000001", "step-00000002", "step-00000003"], 3, ["step-00000001", "step-00000002",
                                                              "step-00000003"]),
    (["step-00000001", "step-00000002", "step-00000003"], 2, ["step-00000002", "step-00000003"]),
    (["step-00000002.tmp"], 1, ["step-00000002.tmp"]),                # no finished step: nothing is judged
    (["step-00000001", "step-1.tmp", "notes"], 1, ["notes", "step-00000001", "step-1.tmp"]),  # not our names
])
def test_prune_keeps_the_newest_steps_and_a_later_steps_temporary_folder(tmp_path, names, keep, left):
    for n in names:
        (tmp_path / n).mkdir()
    prune(str(tmp_path), keep)
    assert sorted(os.listdir(tmp_path)) == left


def test_list_steps_sees_only_finished_step_folders_oldest_first(tmp_path):
    for n in ("step-00000010", "step-00000002", "step-00000003.tmp", "step-3", "latest"):
        (tmp_path / n).mkdir()
    assert list_steps(str(tmp_path)) == [2, 10]
    assert list_steps(str(tmp_path / "missing")) == []
