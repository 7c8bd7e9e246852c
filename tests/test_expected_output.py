"""Each chapter's "Expected output" block still has the shape of what its lesson prints.

``docs/expected_output.py --write`` put into every chapter the output of its lesson at small
settings (``docs/lessons.py``). The slow test here runs each command again and compares the block's
shape with the fresh output's (every number, quoted sample and measured bar a wildcard): a lesson
that gains or loses a line, or renames a column, fails until the block is written again. The fast
tests check the shape rules themselves on hand-written outputs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))
_spec = importlib.util.spec_from_file_location("docs_expected_output", ROOT / "docs" / "expected_output.py")
eo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eo)
sys.path.remove(str(ROOT / "docs"))


def test_numbers_samples_and_measured_bars_are_wildcards():
    assert eo.shape("ring  5.36e-07   PASS   24,576   1.74 ms\n\n") == ["ring # PASS # ms"]
    assert eo.shape("  > 'The pipeline k\\x0f'   (12 steps/s)") == ["> '~' (# steps/s)"]
    timelines = ["stage 0 |F0ffff..B0bb....O|", "stage 0 |F0f.B0bbbbbbbbbbO|"]
    assert [eo.shape(t) for t in timelines] == [["stage # |~|"]] * 2
    assert eo.shape("r0|############.... r1|################") == ["r#|~ r#|~"]
    assert eo.shape("ratio 1.3 -> MISSED the 30% target") == eo.shape("ratio 0.9 -> MET the 30% target")
    assert eo.shape("check PASS") != eo.shape("check FAIL")


def test_a_new_line_or_a_renamed_column_is_a_different_shape():
    before = "step  loss(serial)  loss(DDP)\n   0   4.17   4.17\nmax diff 1e-16  PASS\n"
    assert eo.shape_diff(before, before.replace("4.17", "3.99")) == ""
    assert eo.shape_diff(before, before.replace("loss(DDP)", "loss(ZeRO)")) != ""
    assert eo.shape_diff(before, before + "a new line\n") != ""
    reordered = "   0   4.17   4.17\n" + before.replace("   0   4.17   4.17\n", "")
    assert eo.shape_diff(before, reordered) == ""  # a table sorted by measured time may come reordered


def test_rows_that_follow_the_timing_count_as_a_set():
    volatile = [r"^shares moved"]
    before = "step 1\nshares moved after step 5\nshares moved after step 7\ndone PASS\n"
    assert eo.shape_diff(before, "step 1\nshares moved after step 3\ndone PASS\n", volatile) == ""
    assert eo.shape_diff(before, "step 1\ndone PASS\n", volatile) != ""      # the kind of line vanished
    assert eo.shape_diff(before, "step 1\nshares moved after step 3\n", volatile) != ""  # so did PASS


def test_a_block_round_trips_and_goes_before_the_exercise(tmp_path):
    chapter = "# 2. All-reduce\n\nText.\n\n## Exercise\n\nWrite it.\n"
    outputs = [("python -m minidist.lessons.allreduce --ranks 2", "ring PASS\n\nsteps 2\n")]
    block = eo.block("02-nonexistent.md", outputs)
    text = eo.insert(chapter, block)
    assert text.index(eo.BEGIN) > text.index("Text.") and text.index(eo.END) < text.index("## Exercise")
    assert eo.documented(text) == outputs
    again = eo.insert(text, eo.block("02-nonexistent.md", [(outputs[0][0], "ring PASS\n")]))
    assert again.count(eo.BEGIN) == 1 and eo.documented(again) == [(outputs[0][0], "ring PASS\n")]
    assert eo.insert("# 16. TPUs\n", block).endswith(eo.END + "\n")  # no exercise: at the end


def test_every_chapter_has_a_block_of_its_commands():
    for chapter in eo.SMALL:
        documented = [c for c, _ in eo.documented((ROOT / "lessons" / chapter).read_text())]
        assert documented == eo.commands(chapter), (
            f"lessons/{chapter}: run `python docs/expected_output.py --write {chapter}`")


@pytest.mark.slow
@pytest.mark.parametrize("chapter", sorted(eo.SMALL))
def test_the_block_still_has_the_shape_of_a_fresh_run(chapter):
    documented = eo.documented((ROOT / "lessons" / chapter).read_text())
    for command, before in documented:
        diff = eo.shape_diff(before, eo.run(command), eo.VOLATILE.get(chapter, ()))
        assert not diff, (f"lessons/{chapter}: `{command}` prints another shape now; run "
                          f"`python docs/expected_output.py --write {chapter}`:\n{diff}")
