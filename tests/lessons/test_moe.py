"""Lesson 15's flags: a run that section 2's check (the aux loss halves the CV of tokens per expert)
could never pass is refused before any rank starts, and the least run allowed passes it."""

import pytest

from minidist.lessons import moe


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        moe.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def no_launch(monkeypatch):
    started = []
    monkeypatch.setattr(moe, "launch", lambda fn, args: started.append(args))
    return started


@pytest.mark.parametrize("steps", ["3", "4", "24"])
def test_too_few_steps_to_rebalance_the_router_are_refused(no_launch, capsys, steps):
    # at the defaults the CV with the aux loss first halves at step 24 (chapter 15): 25 steps
    line = refused(["--ranks", "2", "--experts", "4", "--tokens", "32", "--steps", steps], capsys)
    assert "--steps" in line and "use --steps 25 or more" in line and not no_launch


def test_top_k_of_k_experts_has_nothing_to_balance(no_launch, capsys):
    # k = E: every token goes to every expert, CV 0 with and without the aux loss
    line = refused(["--ranks", "2", "--experts", "2", "--k", "2", "--tokens", "32"], capsys)
    assert "--k" in line and "--experts 4" in line and not no_launch


def test_the_least_steps_allowed_pass_the_check(capsys):
    moe.main(["--ranks", "4", "--steps", "25"])
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("PASS") == 3


def test_too_few_tokens_per_expert_to_halve_the_cv_are_refused(no_launch, capsys):
    # 2 ranks x 16 tokens x top-2 over 4 experts is 16 per expert: its CV with the aux loss falls
    # 0.72 -> 0.62 in 40 steps, not below half of 0.81 without (chapter 15); 32 per expert halves it
    line = refused(["--ranks", "2", "--experts", "4", "--tokens", "16"], capsys)
    assert "--tokens" in line and "--tokens >= 32" in line and not no_launch
