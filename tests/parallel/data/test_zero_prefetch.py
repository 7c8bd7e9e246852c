"""ZeRO-3 with ``prefetch=True``: unit u+1's all-gather starts when unit u's forward starts (before
u+1 is needed), and the training result and the bytes sent are those of ZeRO-3 without prefetch."""

import numpy as np

from minidist.comm import measure, run
from minidist.nn import GPT, optim
from minidist.parallel.data.zero import ZeRO
from tests.parallel.data.conftest import CFG


def _train(comm, prefetch):
    cfg = CFG.replace(n_layer=2)
    m = GPT(cfg)
    z = ZeRO(m, comm, lambda ps: optim.AdamW(ps, lr=1e-2), stage=3, bucket_bytes=3000, prefetch=prefetch)
    events = []
    gather, start = z.gather_unit, z.prefetch_unit
    z.gather_unit = lambda u, phase="backward": (events.append((phase, u)), gather(u, phase))[1]
    z.prefetch_unit = lambda u: (events.append(("prefetch", u)), start(u))[1]
    rng = np.random.default_rng(comm.rank)
    with measure(comm) as meas:
        for _ in range(2):
            x = rng.integers(0, cfg.vocab_size, (2, 6))
            z.backward(m.loss(x, x))
            z.step()
    params = {k: np.array(v) for k, v in z.full_parameters().items()}
    return params, events, meas.bytes_sent, len(z.units), z.prefetch_log


def test_prefetch_starts_before_the_unit_is_needed_and_changes_nothing_else():
    p = 3
    plain = run(lambda c: _train(c, False), ranks=p)
    early = run(lambda c: _train(c, True), ranks=p)
    for r in range(p):
        (want, ev0, bytes0, n_units, _), (got, ev, nbytes, _, started) = plain[r], early[r]
        assert got.keys() == want.keys()
        for k in want:  # all-gather concatenates: bit for bit the same parameters
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"rank {r}: {k}")
        assert nbytes == bytes0, f"rank {r}: prefetch sent {nbytes} bytes, without it {bytes0}"
        assert not any(e[0] == "prefetch" for e in ev0)
        for u in range(1, n_units):  # in each step: prefetch u, then (later) unit u's forward gather
            starts = [i for i, e in enumerate(ev) if e == ("prefetch", u)]
            needs = [i for i, e in enumerate(ev) if e == ("forward", u)]
            assert len(starts) == len(needs) == 2, (u, ev)
            assert all(s < n for s, n in zip(starts, needs)), f"rank {r}: unit {u} prefetched late: {ev}"
        assert started == 2 * list(range(1, n_units)), "the last unit has no next one to prefetch"
