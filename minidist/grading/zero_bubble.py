"""Grader for exercises/zero_bubble.py: the student's ZB-H1 schedule, run by minidist's simulator.

``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. Every size of the grid
p = 1..6 stages, m in {p, p + 1, 2p, 3p} microbatches is tried (the simulator takes milliseconds),
checking the spec's constraints in this order, each failure naming its problem:

1. structure: p stage lists; on every stage each microbatch's Forward, BackwardInput (B) and
   BackwardWeight (W) exactly once (no whole ``Backward``), one OptimizerStep at the end;
2. dependency order (``simulate.validate``): F before B before W, a receive before the compute that
   needs it, a send after the compute that made it;
3. no deadlock with blocking sends (a send completes when its receive is posted);
4. in flight: at most p - s microbatches between F and B on stage s (1F1B's M_B);
5. memory: at most p microbatches between F and W on any stage;
6. W order: each stage's W's in the order of its B's (the oldest put-off W first);
7. speed: with F = B = W = 1 and background sends (the runtime's ``isend``), a makespan of at most
   the floor 3m + p - 1 (1F1B takes 3(m + p - 1)).

They run here against minidist's own schedule (must pass) and broken ones (must fail).
"""

import types

from minidist.parallel.pipeline import schedule as S
from minidist.parallel.pipeline import zero_bubble as Z
from minidist.parallel.pipeline.greedy import greedy_order
from minidist.parallel.pipeline.placement import looped
from minidist.parallel.pipeline.simulate import DeadlockError, peak_activations, simulate

SIZES = [(p, m) for p in range(1, 7) for m in sorted({p, p + 1, 2 * p, 3 * p})]
UNIT = dict(fwd_time=1.0, bwd_time=2.0, input_time=1.0, weight_time=1.0)  # F = B = W = 1


def _held_until_w(ops) -> int:
    """Most microbatches at once whose Forward has run and whose BackwardWeight has not."""
    held = peak = 0
    for i in ops:
        held += isinstance(i, S.Forward) - isinstance(i, S.BackwardWeight)
        peak = max(peak, held)
    return peak


def _structure(sched, p, m, what):
    assert isinstance(sched, list) and len(sched) == p and all(isinstance(o, list) for o in sched), \
        f"{what} must return a list of {p} instruction lists (one per stage), got {type(sched).__name__}"
    for s, ops in enumerate(sched):
        whole = sorted(i.mb for i in ops if isinstance(i, S.Backward))
        assert not whole, (f"{what}: stage {s} runs Backward (whole) for mbs {whole}: ZB-H1 splits each "
                           f"backward into BackwardInput (B, sent on at once) and BackwardWeight (W, put "
                           f"off)")
        for kind in (S.Forward, S.BackwardInput, S.BackwardWeight):
            mbs = sorted(i.mb for i in ops if isinstance(i, kind))
            missing = sorted(set(range(m)) - set(mbs))
            assert mbs == list(range(m)), (
                f"{what}: stage {s} runs {kind.__name__} of mbs {mbs}, expected each of 0..{m - 1} once"
                + (f" (missing: {missing})" if missing else ""))
        chunks = sorted({i.chunk for i in ops if hasattr(i, "chunk")})
        assert chunks in ([0], []), f"{what}: stage {s} uses model chunks {chunks}; ZB-H1 has one (chunk 0)"
        steps = [k for k, i in enumerate(ops) if isinstance(i, S.OptimizerStep)]
        assert steps == [len(ops) - 1], f"{what}: stage {s} must end with exactly one OptimizerStep()"


def _simulated(sched, what, **kw):
    try:
        return simulate(sched, **UNIT, **kw)
    except DeadlockError as e:
        raise AssertionError(f"{what} deadlocks with blocking sends: {e}. Post each send together "
                             f"with the next receive in one SendRecv, as the spec says") from None
    except S.ScheduleError as e:
        raise AssertionError(f"{what} runs an instruction before what it depends on: {e}") from None


def check_zb_h1(impl):
    for p, m in SIZES:
        what = f"zb_h1({p}, {m})"
        sched = impl.zb_h1(p, m)
        _structure(sched, p, m, what)
        _simulated(sched, what)  # rendezvous: must not deadlock
        for s, ops in enumerate(sched):
            fb = peak_activations(ops)
            assert fb <= p - s, (f"{what}: stage {s} holds {fb} microbatches between Forward and "
                                 f"BackwardInput at once; 1F1B's limit there is p - s = {p - s} (its peak "
                                 f"activations): wait for a B before the next F")
            held = _held_until_w(ops)
            assert held <= p, (f"{what}: stage {s} holds {held} microbatches between Forward and "
                               f"BackwardWeight at once; at most p = {p} (a put-off W keeps its inputs "
                               f"alive: run a W before taking more)")
            bs = [i.mb for i in ops if isinstance(i, S.BackwardInput)]
            ws = [i.mb for i in ops if isinstance(i, S.BackwardWeight)]
            assert ws == bs, (f"{what}: stage {s} runs its W's for microbatches {ws}, its B's for {bs}; the "
                              f"spec's W order is the B's (the oldest put-off W first), so each weight "
                              f"gradient adds up its microbatches in 1F1B's order")
        got = _simulated(sched, what, buffered_sends=True)
        floor = 3 * m + p - 1
        assert got.makespan <= floor, (
            f"{what}: makespan {got.makespan:g} steps with F = B = W = 1 (bubble {got.bubble:.3f}); ZB-H1 "
            f"reaches the floor 3m + p - 1 = {floor}, bubble {(p - 1) / floor:.3f}; 1F1B takes "
            f"{3 * (m + p - 1)}. Every stage may wait only p - 1 steps in all: find which W's to put "
            f"off, and how long, so that the cool-down has W's to fill it")
    for bad in [(0, 4), (3, 2), (4, 3)]:
        try:
            impl.zb_h1(*bad)
        except ValueError:
            continue
        raise AssertionError(f"zb_h1{bad} must raise ValueError: ZB-H1 needs num_stages >= 1 and "
                             f"num_microbatches >= num_stages")


def check_zb_h1_bubble(impl):
    for p in range(1, 9):
        for m in range(p, 4 * p + 1):
            got = impl.zb_h1_bubble(p, m)
            want = (p - 1) / (3 * m + p - 1)  # (p - 1) idle steps per stage of 3m + p - 1, written out
            assert abs(got - want) < 1e-12, (f"zb_h1_bubble({p}, {m}) = {got}; with F = B = W only the B "
                                             f"chain waits: (p-1)/(3m+p-1) = {want}")


CHECKS = {"zb_h1": check_zb_h1, "zb_h1_bubble": check_zb_h1_bubble}
POINTS = {"zb_h1": 3, "zb_h1_bubble": 1}


def reference():
    return types.SimpleNamespace(zb_h1=Z.zb_h1, zb_h1_bubble=Z.zb_h1_bubble_formula)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _w_before_b(p, m):  # each microbatch's W where its B belongs and B where W does
    swap = {S.BackwardInput: S.BackwardWeight, S.BackwardWeight: S.BackwardInput}
    return [[swap[type(i)](i.mb) if type(i) in swap else i for i in ops] for ops in Z.zb_h1(p, m)]


def _forgets_last_w(p, m):  # the last microbatch's weight gradients never computed
    return [[i for i in ops if i != S.BackwardWeight(m - 1)] for ops in Z.zb_h1(p, m)]


def _sends_first(p, m):  # each SendRecv as a blocking send, then the receive: neighbours both send
    def split(ops):
        out = []
        for i in ops:
            parts = sorted(i.ops, key=lambda x: not isinstance(x, (S.SendAct, S.SendGrad))) \
                if isinstance(i, S.SendRecv) else [i]
            out += parts
        return out
    return [split(ops) for ops in Z.zb_h1(p, m)]


def _one_f_one_b_split_in_place(p, m):  # 1F1B with W right after its B: nothing fills the wait
    if m < p or p < 1:
        raise ValueError("num_microbatches must be >= num_stages")
    return [[x for i in ops for x in ((S.BackwardInput(i.mb), S.BackwardWeight(i.mb))
                                      if isinstance(i, S.Backward) else (i,))]
            for ops in S.one_f_one_b(p, m)]


def _no_memory_cap(p, m):  # the greedy order without the p-in-flight caps: the floor, m held
    Z.check_min("zb_h1", p, m, p)
    return Z.as_schedule(greedy_order(looped(p), m, lambda r, c: m, held=m), looped(p))


def _greedy_of_the_old_spec(p, m):  # B, else F within the limits, else the oldest W: 2 steps over
    Z.check_min("zb_h1", p, m, p)
    return Z.as_schedule(greedy_order(looped(p), m, lambda r, c: p - r, held=p), looped(p))


def _one_more_in_flight(p, m):  # stages 1.. warm up one forward more, one W less put off: within p
    Z.check_min("zb_h1", p, m, p)  # from F to W, but p - s + 1 between F and B, over 1F1B's limit
    order = []
    for s, ops in enumerate(Z.zb_h1_order(p, m)):
        if s == 0:
            order.append(ops)
            continue
        k, d, new = min(m, p - s + 1), s - 1, [S.Forward(i) for i in range(min(m, p - s + 1))]
        for j in range(m):
            new += [S.BackwardInput(j)] + ([S.BackwardWeight(j - d)] if j >= d else [])
            new += [S.Forward(k + j)] if k + j < m else []
        order.append(new + [S.BackwardWeight(j) for j in range(m - d, m)])
    return Z.as_schedule(order, looped(p))


def _newest_w_first(p, m):  # the same slots, each W the newest put-off one (a stack, not a queue)
    out = []
    for ops in Z.zb_h1(p, m):
        put_off, new = [], []
        for i in ops:
            if isinstance(i, S.BackwardInput):
                put_off.append(i.mb)
            new.append(S.BackwardWeight(put_off.pop()) if isinstance(i, S.BackwardWeight) else i)
        out.append(new)
    return out


def _whole_backward(p, m):  # plain 1F1B: the backward never split
    return S.one_f_one_b(p, m)


def _bubble_of_1f1b(p, m):
    return (p - 1) / (m + p - 1)


def _bubble_a_third_of_1f1b(p, m):  # a third of 1F1B's bubble fraction: close, but not the same thing
    return (p - 1) / (3 * (m + p - 1))


BROKEN = {"zb_h1": [_w_before_b, _forgets_last_w, _sends_first, _one_f_one_b_split_in_place, _no_memory_cap,
                    _whole_backward, _greedy_of_the_old_spec, _newest_w_first, _one_more_in_flight],
          "zb_h1_bubble": [_bubble_of_1f1b, _bubble_a_third_of_1f1b]}
