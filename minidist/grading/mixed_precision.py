"""Grader for exercises/mixed_precision.py: the dynamic loss scaler, the agreed inf flag, the step.

The scaler is replayed against the rules written out here (``_expected_states``); the flag and the
step run on 1..4 thread ranks with an inf or NaN planted on one rank, and every rank must agree.
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.comm import all_reduce, measure
from minidist.grading import assert_close, no_hang, run_guarded, untouched
from minidist.parallel.memory import precision as P

GRADE = settings(max_examples=15, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
WAIT_S = 10


def _expected_states(flags, interval, init=2.0 ** 4, grow=2.0, back=0.5, floor=1.0):
    """The rules of the spec, one step at a time."""
    out, scale, clean, skipped = [], init, 0, 0
    for f in flags:
        if f:
            scale, clean, skipped = max(scale * back, floor), 0, skipped + 1
        else:
            clean += 1
            if clean == interval:
                scale, clean = scale * grow, 0
        out.append({"scale": scale, "clean_steps": clean, "skipped": skipped})
    return out


def check_scaler_update(impl):
    @GRADE
    @given(flags=st.lists(st.booleans(), min_size=1, max_size=12), interval=st.integers(1, 4))
    @example(flags=[False, False, False, False], interval=2)
    @example(flags=[True] * 6, interval=3)  # down to min_scale and no further
    def prop(flags, interval):
        state = {"scale": 2.0 ** 4, "clean_steps": 0, "skipped": 0}
        for i, (f, want) in enumerate(zip(flags, _expected_states(flags, interval))):
            state = untouched(impl.scaler_update)(state, f, growth_interval=interval)
            got = {k: state.get(k) for k in want} if isinstance(state, dict) else state
            assert got == want, (f"growth_interval={interval}, found_inf sequence {flags[:i + 1]}: after "
                                 f"step {i} the state is {got}, expected {want}")
    prop()


def _planted(p, bad_rank, kind, seed):
    rng = np.random.default_rng(seed)
    grads = [[rng.standard_normal(3), rng.standard_normal((2, 2))] for _ in range(p)]
    if bad_rank is not None:
        grads[bad_rank][1][1, 0] = np.inf if kind == "inf" else np.nan
    return grads


def check_found_inf_across(impl):
    @GRADE
    @given(p=st.integers(1, 4), kind=st.sampled_from(["inf", "nan", None]), seed=st.integers(0, 9),
           data=st.data())
    @example(p=2, kind="inf", seed=0, data=None)
    def prop(p, kind, seed, data):
        bad = None if kind is None else (data.draw(st.integers(0, p - 1)) if data else p - 1)
        grads = _planted(p, bad, kind, seed)
        def body(c):
            with measure(c) as m:
                got = untouched(impl.found_inf_across)(c, grads[c.rank])
            return got, [call.name for call in m.calls]
        out = run_guarded(body, p, WAIT_S)
        for r, (got, calls) in enumerate(out):
            assert p == 1 or len(calls) == 1 and calls[0].endswith("all_reduce"), (
                f"rank {r} of {p}: collectives {calls}; the spec's one all-reduce of a 0/1 flag does it "
                f"(a flag for all of this rank's {len(grads[r])} gradients together)")
            assert bool(got) == (bad is not None), (
                f"rank {r} of {p}: found_inf_across returned {got!r}, but "
                + (f"rank {bad} has a{'n' if kind == 'inf' else ''} {kind} in its gradients (every rank must "
                   f"say True)" if bad is not None else "no rank has an inf or NaN"))
    no_hang(prop)


def check_scaled_sgd_step(impl):
    @GRADE
    @given(p=st.integers(1, 4), kind=st.sampled_from(["inf", "nan", None]), seed=st.integers(0, 9),
           interval=st.integers(1, 3))
    @example(p=3, kind="inf", seed=0, interval=2)
    @example(p=2, kind=None, seed=1, interval=1)
    def prop(p, kind, seed, interval):
        bad = None if kind is None else seed % p
        grads = _planted(p, bad, kind, seed)
        rng = np.random.default_rng(seed + 100)
        params = [rng.standard_normal(3), rng.standard_normal((2, 2))]
        state = {"scale": 8.0, "clean_steps": 0, "skipped": 0}
        lr = 0.1

        def body(c):
            step = untouched(impl.scaled_sgd_step)
            return step(c, [q.copy() for q in params], grads[c.rank], dict(state), lr,
                        growth_interval=interval)
        out = run_guarded(body, p, WAIT_S)
        want_state = _expected_states([bad is not None], interval, init=8.0)[0]
        for r, (new, st_) in enumerate(out):
            skip = bad is not None
            what = f"rank {r} of {p}" + (f", {kind} planted on rank {bad}" if skip else ", no overflow")
            want = params if skip else [q - lr * g / 8.0 for q, g in zip(params, grads[r])]
            rule = " (the step must be skipped)" if skip else " (p - lr * g / S)"
            for i, (g, w) in enumerate(zip(new, want)):
                assert_close(g, w, f"{what}: parameter {i}{rule}", rtol=1e-12, atol=1e-15)
            got_state = {k: st_.get(k) for k in want_state}
            assert got_state == want_state, f"{what}: scaler state {got_state}, expected {want_state}"
    no_hang(prop)


CHECKS = {"scaler_update": check_scaler_update, "found_inf_across": check_found_inf_across,
          "scaled_sgd_step": check_scaled_sgd_step}
POINTS = {"scaler_update": 2, "found_inf_across": 2, "scaled_sgd_step": 3}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def reference():
    def scaler_update(state, found_inf, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5,
                      min_scale=1.0):
        s = P.DynamicLossScaler(state["scale"], growth_factor, backoff_factor, growth_interval, min_scale)
        s.clean_steps, s.skipped = state["clean_steps"], state["skipped"]
        s.update(found_inf)
        return s.state_dict()

    def found_inf_across(comm, grads):
        return P.found_inf_across(P.has_inf_or_nan(grads), [comm])

    def scaled_sgd_step(comm, params, scaled_grads, state, lr, growth_interval=2000):
        found = found_inf_across(comm, scaled_grads)
        new = params if found else [q - lr * (g / state["scale"]) for q, g in zip(params, scaled_grads)]
        return [q.copy() for q in new], scaler_update(state, found, growth_interval)

    return types.SimpleNamespace(scaler_update=scaler_update, found_inf_across=found_inf_across,
                                 scaled_sgd_step=scaled_sgd_step)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _grow_one_late(state, found_inf, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5,
                   min_scale=1.0):  # grows after growth_interval + 1 clean steps
    s = dict(state)
    if found_inf:
        s.update(scale=max(s["scale"] * backoff_factor, min_scale), clean_steps=0, skipped=s["skipped"] + 1)
    else:
        s["clean_steps"] += 1
        if s["clean_steps"] > growth_interval:
            s.update(scale=s["scale"] * growth_factor, clean_steps=0)
    return s


def _no_reset_on_inf(state, found_inf, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5,
                     min_scale=1.0):  # an overflow does not restart the count of clean steps
    s = dict(state)
    if found_inf:
        s.update(scale=max(s["scale"] * backoff_factor, min_scale), skipped=s["skipped"] + 1)
    else:
        s["clean_steps"] += 1
        if s["clean_steps"] >= growth_interval:
            s.update(scale=s["scale"] * growth_factor, clean_steps=0)
    return s


def _no_floor(state, found_inf, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5,
              min_scale=1.0):  # halves below min_scale: a long run of overflows drives it to 0
    return reference().scaler_update(state, found_inf, growth_interval, growth_factor, backoff_factor, 0.0)


def _local_flag(comm, grads):  # only the rank with the inf knows: the others step
    return any(not np.isfinite(g).all() for g in grads)


def _isinf_only(comm, grads):  # NaN is not inf: a NaN gradient goes unnoticed
    flag = np.array([float(any(np.isinf(g).any() for g in grads))])
    return bool(all_reduce(comm, flag, op="max")[0] > 0)


def _flag_per_gradient(comm, grads):  # right answer, but one all-reduce per gradient: len(grads) waits
    return any([bool(all_reduce(comm, np.array([float(not np.isfinite(g).all())]), op="max")[0] > 0)
                for g in grads])


def _sum_flag_per_rank(comm, grads):  # averages the flags: true only if every rank overflowed
    flag = np.array([float(any(not np.isfinite(g).all() for g in grads))])
    return bool(all_reduce(comm, flag, op="sum")[0] >= comm.size)


def P_found(comm, grads):
    return reference().found_inf_across(comm, grads)


def _step_with(flag_fn, unscale=True):
    ref = reference()

    def step(comm, params, scaled_grads, state, lr, growth_interval=2000):
        found = flag_fn(comm, scaled_grads)
        s = state["scale"] if unscale else 1.0
        new = params if found else [q - lr * (g / s) for q, g in zip(params, scaled_grads)]
        return [q.copy() for q in new], ref.scaler_update(state, found, growth_interval)
    step.__name__ = f"step_with_{flag_fn.__name__}" + ("" if unscale else "_not_unscaled")
    return step


def _update_in_place(state, found_inf, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5,
                     min_scale=1.0):  # right new state, but written into the caller's dict as well
    state.update(reference().scaler_update(dict(state), found_inf, growth_interval, growth_factor,
                                           backoff_factor, min_scale))
    return state


BROKEN = {"scaler_update": [_grow_one_late, _no_reset_on_inf, _no_floor, _update_in_place],
          "found_inf_across": [_local_flag, _isinf_only, _sum_flag_per_rank, _flag_per_gradient],
          "scaled_sgd_step": [_step_with(_local_flag), _step_with(P_found, unscale=False)]}
