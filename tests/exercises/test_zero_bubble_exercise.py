"""CI for the zero_bubble grader (minidist/grading/zero_bubble.py): minidist's ZB-H1 gets full marks, every
broken version in its BROKEN fails its task with a message, the untouched exercises/zero_bubble.py scores
0, and a schedule written from the exercise's spec alone passes."""

from minidist.grading import grader_tests
from minidist.grading import zero_bubble as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("zero_bubble", G.CHECKS, G.reference, G.BROKEN)


def _zb_h1_from_the_spec(p, m):
    """exercises/zero_bubble.py's docstring followed step by step, without minidist's code: it must pass."""
    from minidist.parallel.pipeline import schedule as S

    if p < 1 or m < p:
        raise ValueError("needs num_stages >= 1 and num_microbatches >= num_stages")
    here_act = [{i: 0 for i in range(m)}] + [{} for _ in range(p - 1)]  # stage -> mb -> step it is here
    here_grad = [{} for _ in range(p)]
    nf, nb, nw, put_off, order = [0] * p, [0] * p, [0] * p, [[] for _ in range(p)], [[] for _ in range(p)]
    t = 0
    while any(nb[s] < m or put_off[s] for s in range(p)):
        for s in range(p):
            if nb[s] < nf[s] and here_grad[s].get(nb[s], 1e9) <= t:
                order[s].append(S.BackwardInput(nb[s]))
                put_off[s].append(nb[s])
                if s > 0:
                    here_grad[s - 1][nb[s]] = t + 1
                nb[s] += 1
            elif (nf[s] < m and here_act[s].get(nf[s], 1e9) <= t and nf[s] - nb[s] < p - s
                  and nf[s] - nw[s] < p):
                order[s].append(S.Forward(nf[s]))
                (here_act[s + 1] if s < p - 1 else here_grad[s])[nf[s]] = t + 1
                nf[s] += 1
            elif put_off[s]:
                order[s].append(S.BackwardWeight(put_off[s].pop(0)))
                nw[s] += 1
        t += 1
    sched = []
    for s, ops in enumerate(order):
        def recv(op, s=s):
            if isinstance(op, S.Forward) and s > 0:
                return S.RecvAct(op.mb)
            return S.RecvGrad(op.mb) if isinstance(op, S.BackwardInput) and s < p - 1 else None

        def send(op, s=s):
            if isinstance(op, S.Forward) and s < p - 1:
                return S.SendAct(op.mb)
            return S.SendGrad(op.mb) if isinstance(op, S.BackwardInput) and s > 0 else None
        out = [x for x in [recv(ops[0])] if x]
        for k, op in enumerate(ops):
            both = [x for x in (send(op), recv(ops[k + 1]) if k + 1 < len(ops) else None) if x]
            out += [op] + ([S.SendRecv(tuple(both))] if len(both) == 2 else both)
        sched.append(out + [S.OptimizerStep()])
    return sched


def test_a_schedule_written_from_the_spec_alone_passes():
    import types

    G.check_zb_h1(types.SimpleNamespace(zb_h1=_zb_h1_from_the_spec))
