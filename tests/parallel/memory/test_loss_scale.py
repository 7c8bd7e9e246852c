"""fp16's loss scale and the agreed flag (``minidist.parallel.memory.loss_scale``): the scaler's
halving and doubling step by step, and the flag's OR over groups of 4 threads ranks."""

from minidist.comm import run
from minidist.parallel.memory.loss_scale import DynamicLossScaler, found_inf_across


def test_loss_scaler_halves_on_inf_and_doubles_after_clean_steps():
    s = DynamicLossScaler(growth_interval=3)
    assert s.scale == 2.0 ** 16
    s.update(True)
    assert s.scale == 2.0 ** 15 and s.skipped == 1
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0 ** 16
    s.update(False)
    s.update(True)
    assert s.scale == 2.0 ** 15 and s.clean_steps == 0
    assert DynamicLossScaler().growth_interval == 2000


def test_found_inf_across_groups_is_an_or():
    def fn(comm):
        a = comm.split(comm.rank // 2, comm.rank)
        b = comm.split(comm.rank % 2, comm.rank)
        return found_inf_across(comm.rank == 2, [a, b]), found_inf_across(False, [a, b])
    assert run(fn, ranks=4) == [(True, False)] * 4
