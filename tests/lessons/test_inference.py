"""Lesson 9's own arithmetic and pictures, section by section (each section is its own file)."""

from minidist.lessons import inference_batching, inference_kv


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
