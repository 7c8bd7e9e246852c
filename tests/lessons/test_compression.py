"""Lesson 12's bytes at dense's loss (compression_curves): where each held-out curve enters the band."""

import pytest

from minidist.lessons import compression, compression_curves


def result(name, evals):
    return {"name": name, "evals": evals}


DENSE = result("dense", [(4, 40e6, 4.0), (8, 80e6, 3.2), (12, 120e6, 3.0)])
# reaches 3.0·1.02 = 3.06 at its second evaluation, after 4 MB: dense needed 120 MB -> 1/30
POWER = result("PowerSGD", [(4, 2e6, 4.2), (8, 4e6, 3.05), (12, 6e6, 3.01)])
# DiLoCo sends nothing before its first sync: no point at 0 bytes (a log axis has no place for it)
DILOCO = result("DiLoCo", [(4, 0, 4.5), (8, 0, 4.0), (12, 10e6, 3.5)])


def test_the_ratio_is_dense_bytes_over_the_methods_where_the_band_is_reached():
    level, rows = compression_curves.bytes_at_dense_loss([DENSE, POWER, DILOCO])
    assert level == pytest.approx(3.0 * (1 + compression_curves.BAND))
    assert rows[0] == ("dense", pytest.approx(120.0), pytest.approx(1.0))
    assert rows[1] == ("PowerSGD", pytest.approx(4.0), pytest.approx(120 / 4))
    assert rows[2] == ("DiLoCo", None, None)  # 3.5 never comes down to 3.06


def test_curves_start_at_the_first_message_not_at_zero_bytes():
    steps, mb, loss = compression_curves.curve(DILOCO)
    assert list(steps) == [12] and list(mb) == [10.0] and list(loss) == [3.5]


def test_the_plot_is_written(tmp_path):
    path = tmp_path / "comp.png"
    compression_curves.plot(str(path), [DENSE, POWER, DILOCO])
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_the_plot_is_written_when_a_method_sent_nothing_in_the_steps(tmp_path):
    # issue 28: --steps 4 with DiLoCo H=20 -- one evaluation each, DiLoCo's at 0 bytes
    path = tmp_path / "few.png"
    silent = result("DiLoCo H=20", [(4, 0, 4.5)])
    compression_curves.plot(str(path), [result("dense", [(4, 40e6, 4.0)]), silent])
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert [len(a) for a in compression_curves.curve(silent)] == [0, 0, 0]


def test_evaluations_cost_no_bytes_and_the_lesson_prints_the_ratio(capsys):
    compression.main("--ranks 2 --steps 4 --eval-every 2 --layers 1 --d-model 16 --seq 8 --batch 1 "
                     "--link off --methods dense".split() + ["PowerSGD r=2"])
    out = capsys.readouterr().out
    assert "bytes == formula" in out and "FAIL" not in out  # held-out evaluation sent nothing
    assert "MB rank 0 sent until its held-out loss reached dense's final" in out
    assert "of dense's bytes" in out


def _row(name, total, steps=8, final=5.0, step_s=0.004):
    return {"name": name, "sent": [total // steps] * steps, "total": total, "formula": total,
            "identical": True, "final": final, "step_s": step_s}


def test_a_method_that_sent_nothing_prints_no_ratio_and_the_columns_stay_apart():
    """DiLoCo H=20 in 8 steps sends 0 bytes: the ratio is undefined ('-'), never dense's byte count run
    into the bytes column (the table once printed '0   0372224.0x')."""
    dense, diloco, half = _row("dense", 372_224), _row("DiLoCo H=20", 0), _row("bf16", 186_112)
    header = compression.table_header()
    rows = [compression.table_row(r, dense) for r in (dense, diloco, half)]
    cells = [row[18:].split() for row in rows]                            # after the 18-wide name
    assert cells[1][:3] == ["0", "0", "-"]
    assert cells[0][2] == "1.0x" and cells[2][2] == "2.0x"                 # 372224 / 186112
    end = header.index("ratio") + len("ratio")                            # right-aligned under 'ratio'
    assert all(row[end - 1] in "x-" and row[end] == " " for row in rows), rows
    assert len({len(c) for c in cells}) == 1


def test_the_bytes_at_an_evaluation_are_the_syncs_started_not_what_the_link_carried_yet():
    """A streaming DiLoCo sync leaves on the async worker whenever the link takes it: the bytes an
    evaluation is charged are those of the syncs started so far (the plot's x), the same every run."""
    from types import SimpleNamespace as NS

    wrapper = NS(fragments=[NS(buckets=[NS(numel=6), NS(numel=4)]), NS(buckets=[NS(numel=8)])],
                 started=[(0, 0), (3, 1)])
    # p = 2, float32: a ring all-reduce of n elements sends 2N - |c0| - |c1| = N = 4n bytes from rank 0
    assert compression.bytes_so_far("diloco", wrapper, sent=[0, 0, 0, 0], p=2) == 4 * 10 + 4 * 8
    assert compression.bytes_so_far("powersgd", wrapper, sent=[5, 7], p=2) == 12  # DDP hooks: each step's
