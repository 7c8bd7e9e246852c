"""Lesson 9's own arithmetic and pictures, section by section (each section is its own file)."""

import pytest

from minidist.infer.generate import check_prompts
from minidist.lessons import inference, inference_batching, inference_kv


def test_why_not_38x_recovers_the_fixed_and_per_token_costs_it_was_built_from():
    # a pass costs F = 1 ms plus c = 10 us per token; p = 10 prompt tokens, n = 20 new ones
    p, n, fixed, per_token = 10, 20, 1e-3, 10e-6
    t_cache = n * fixed + (p + n) * per_token            # p + n tokens through the model
    t_full = n * fixed + sum(p + t for t in range(n)) * per_token   # 390 tokens
    text = inference_kv.why_not_38x(p, n, t_cache, t_full)
    assert "13x the tokens" in text and f"{t_full / t_cache:.1f}x the time" in text
    assert "a fixed 1.00 ms" in text and "plus 10 us per token" in text
    assert f"{n * fixed / t_cache:.0%} fixed cost" in text


def test_the_slot_timeline_writes_each_requests_letter_and_idle_dots():
    history = [{0: 0, 1: 1}, {0: 0}, {1: 27}]  # step -> {slot: request id}
    rows = inference_batching.slot_timeline(history, slots=2)
    assert rows == ["   slot 0 |aa.|", "   slot 1 |b.b|"]  # request 27 is letter 27 % 26 = b


def test_block_too_short_for_speculative_answers_is_refused_before_ranks_start(monkeypatch, capsys):
    # "A neural network " is 17 bytes (byte tokenizer); section 4 generates 40 tokens after it,
    # so check_prompt needs 17 + 40 = 57 positions. Section 5 (24 tokens) needs 41.
    started = []
    monkeypatch.setattr(inference, "launch", lambda fn, args: started.append(args))
    small = ["--ranks", "2", "--steps", "1", "--d-model", "16"]
    with pytest.raises(SystemExit) as e:
        inference.main(small + ["--block", "40"])
    assert e.value.code == 2 and not started
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--block" in err and ">= 57" in err and "--speculative 0" in err
    with pytest.raises(SystemExit):
        inference.main(small + ["--block", "40", "--speculative", "0"])
    assert ">= 41" in capsys.readouterr().err and not started
    inference.main(small + ["--block", "57"])
    assert started and started[0].block == 57
    # the bound is check_prompt's own: 57 fits, 56 does not
    prompts = [inference_kv.enc(q) for q in inference_kv.PROMPTS[:3]]
    check_prompts(prompts, 57, 256, 40)
    with pytest.raises(ValueError):
        check_prompts(prompts, 56, 256, 40)


def test_block_longer_than_the_training_text_allows_is_refused_before_ranks_start(monkeypatch, capsys):
    # build_model trains on batches of 16 windows of block + 1 tokens, every block // 2 tokens: the
    # largest context is the largest block whose TextDataset has >= 16 windows
    from minidist.nn.data import TextDataset, default_text
    tokens = inference_kv.TOK.encode(default_text())
    most = int(len(tokens) * 2 / 17)  # near (N - b) / (b / 2) = 16, then stepped to the exact edge
    while len(TextDataset(tokens, most + 1)) >= 16:
        most += 1
    while len(TextDataset(tokens, most)) < 16:
        most -= 1
    started = []
    monkeypatch.setattr(inference, "launch", lambda fn, args: started.append(args))
    small = ["--ranks", "2", "--steps", "1", "--d-model", "16"]
    for block in (1_000_000, most + 1):  # 1000000 raised TextDataset's ValueError on rank 0
        with pytest.raises(SystemExit) as e:
            inference.main(small + ["--block", str(block)])
        assert e.value.code == 2 and not started
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"the context can be at most {most}; got {block}" in err and "--block" in err
    inference.main(small + ["--block", str(most)])
    assert started and started[0].block == most
