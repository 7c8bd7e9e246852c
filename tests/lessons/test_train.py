"""Lesson 1: --save/--load resuming bit for bit (and refusing another model),
--plot's picture, --prompt and prompts drawn from the training text, a progress bar only on a
terminal. Each run is a GPT of a few thousand parameters trained for a few steps."""

import io
import sys

import numpy as np
import pytest

from minidist.comm import world
from minidist.lessons import train as lesson
from minidist.nn import GPT, GPTConfig
from minidist.resilience import checkpoint

TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--block", "16", "--batch", "4"]


def refused(argv, capsys) -> str:
    """``main(argv)`` exits with status 2 before printing anything; returns its one error line."""
    with pytest.raises(SystemExit) as info:
        lesson.main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "", (argv, info.value.code, out)
    return [line for line in err.splitlines() if line.strip()][-1]


@pytest.fixture
def saved(tmp_path):
    """A checkpoint folder of a 2-step TINY run."""
    root = tmp_path / "ckpt"
    lesson.main([*TINY, "--steps", "2", "--save", str(root)])
    return root


def test_load_builds_the_saved_model_and_refuses_other_sizes(saved, capsys):
    line = refused(["--load", str(saved), "--layers", "3"], capsys)
    assert "--layers" in line and "3" in line and "has 1" in line
    args, _ = lesson.prepare(["--load", str(saved), "--steps", "0"])
    assert (args.layers, args.d_model, args.heads, args.block) == (1, 16, 2, 16)


def _params(root) -> dict:
    """The parameters stored in the newest checkpoint under ``root``, read by the checkpoint loader."""
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, d_model=16, seed=99))
    checkpoint.load(world(), str(root), checkpoint.TrainState(model), required=True)
    return {k: np.array(p.data) for k, p in model.named_parameters()}


def test_save_then_load_resumes_bit_for_bit(tmp_path, saved):
    whole = lesson.main([*TINY, "--steps", "4", "--save", str(tmp_path / "whole")])
    more = lesson.main(["--load", str(saved), "--steps", "2", "--save", str(saved)])
    assert len(whole) == 4 and len(more) == 2
    assert whole[2:] == more  # the same float, not a close one: the resumed steps are the same steps
    a, b = _params(tmp_path / "whole"), _params(saved)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_steps_0_with_load_only_samples_the_saved_model(saved, capsys):
    capsys.readouterr()
    lesson.main(["--load", str(saved), "--steps", "0", "--prompt", "The ring "])
    out = capsys.readouterr().out
    assert "loaded step 2" in out and "trained" not in out
    assert "  > 'The ring " in out


def test_prompt_is_continued_and_default_prompts_come_from_the_training_text(tmp_path, capsys):
    lesson.main([*TINY, "--steps", "1", "--prompt", "Zebra crossing "])
    samples = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  > ")]
    assert len(samples) == 1 and samples[0].startswith("  > 'Zebra crossing ")
    lines = ["Quokkas hop over the fence", "Narwhals swim under ice", "Pangolins curl up tight"]
    text = tmp_path / "animals.txt"
    text.write_text("\n".join(lines * 20) + "\n")
    lesson.main([*TINY, "--steps", "1", "--text", str(text)])
    samples = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  > ")]
    starts = {" ".join(x.split()[:3]) + " " for x in lines}
    assert len(samples) == 3
    assert all(any(s.startswith(f"  > '{p}") for p in starts) for s in samples), samples


def test_prompts_from_are_line_starts_of_the_text():
    text = "alpha beta gamma delta\n  indented line\nBravo charlie delta echo\n3 numbers first\n"
    got = lesson.prompts_from(text, count=5, seed=1, words=2)
    assert set(got) <= {"alpha beta ", "Bravo charlie "} and len(got) == 5
    assert set(lesson.prompts_from("1 22 333", count=4, words=2)) <= {"22 333 ", "333 "}  # after spaces
    assert lesson.prompts_from("#" * 40, count=2) == ["#" * 40 + " "] * 2  # one line, one word


def test_plot_draws_the_loss_curve_with_title_and_units(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    drawn = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), real(fig, *a, **k))[1])
    path = tmp_path / "loss.png"
    losses = lesson.main([*TINY, "--steps", "3", "--plot", str(path)])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = drawn[0].axes
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "loss (nats/token)" and ax.get_title()
    x, y = ax.lines[0].get_data()
    assert list(x) == [1, 2, 3] and list(y) == losses
    assert ax.lines[-1].get_ydata()[0] == pytest.approx(np.log(256))  # the uniform guess, ln(vocab)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal(monkeypatch, capsys):
    lesson.main([*TINY, "--steps", "3"])
    out = capsys.readouterr().out
    assert "\r" not in out and "step/s" not in out and "train:" not in out
    term = Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    lesson.main([*TINY, "--steps", "3"])
    shown = term.getvalue()
    assert "\r" in shown and "train:" in shown and "3/3" in shown and "loss=" in shown


@pytest.mark.slow
def test_the_jax_backend_trains_to_numpys_losses():
    """The same loop on JAX: float32 on both, the same batches and initial weights, so the losses
    agree to float32 rounding (JAX's XLA fuses and orders sums its own way)."""
    pytest.importorskip("jax")
    from minidist.accel.backend import default_backend

    on_numpy = lesson.main([*TINY, "--steps", "3", "--backend", "numpy"])
    on_jax = lesson.main([*TINY, "--steps", "3", "--backend", "jax"])
    np.testing.assert_allclose(on_jax, on_numpy, rtol=1e-5)
    assert default_backend().name == "numpy"  # main left the caller's default as it was
