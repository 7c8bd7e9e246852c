"""A heal moves a live peer's whole state -- parameters, AdamW's m and v, the RNG streams, the data
position, the step -- so the replacement equals the donor bit for bit; a state that does not fit is a
clear error naming the first difference."""

import numpy as np
import pytest

from minidist.autograd import random as mrandom
from minidist.comm import run
from minidist.nn import GPT, GPTConfig
from minidist.nn.data import BatchLoader, SyntheticTask
from minidist.nn.optim import make_optimizer
from minidist.resilience.checkpoint import TrainState
from minidist.resilience.live.errors import HealFailed
from minidist.resilience.live.heal import pack_state, recv_state, send_packed

CFG = GPTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=2, d_model=8, dropout=0.1, dtype="float64",
                seed=1)


class Counter:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def _job(cfg, seed, steps):
    """A GPT trained ``steps`` steps with AdamW (its own seed: a replacement's differs)."""
    mrandom.manual_seed(seed)
    model = GPT(cfg.replace(seed=seed))
    opt = make_optimizer("adamw", model.parameters(), 1e-2)
    loader = BatchLoader(SyntheticTask("sort", length=4, size=64, seed=0), 4, seed=0)
    rng, counter = np.random.default_rng(seed), Counter()
    for _ in range(steps):
        x, y = loader.next_batch()
        rng.integers(10)
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
        counter.step += 1
    state = TrainState(model=model, optimizer=opt, objects={"loader": loader, "trainer": counter},
                       rngs={"job": rng})
    return state


def _everything(state):
    slots, _ = state.slots()
    return {s.name: np.array(s.get()) for s in slots}, state.small_state()


def test_a_heal_makes_the_replacement_equal_to_its_donor_bit_for_bit():
    def fn(comm):
        if comm.rank == 0:
            state = _job(CFG, 7, steps=3)
            nbytes = send_packed(comm, 1, pack_state(state, state.small_state()))
            return _everything(state), nbytes
        state = _job(CFG, 99, steps=0)          # fresh: no AdamW state yet, another init, another RNG
        nbytes = recv_state(comm, 0, state)
        return _everything(state), nbytes
    (donor, sent), (healed, got) = run(fn, ranks=2)
    assert donor[0].keys() == healed[0].keys() and any(k.startswith("optim/m/") for k in donor[0])
    for name in donor[0]:
        assert np.array_equal(donor[0][name], healed[0][name]), name
    assert donor[1] == healed[1]   # AdamW's step count and lr, loader position, step, every RNG stream
    n_params = sum(p.size for p in GPT(CFG).parameters())
    assert sent == got == 3 * n_params * 8  # parameters + m + v, float64: the checkpoint's arrays, once


def test_the_small_state_sent_is_the_one_handed_not_the_donors_current_one():
    """The donor hands its start-of-step small state: the data position sent is that one."""
    def fn(comm):
        if comm.rank == 0:
            state = _job(CFG, 7, steps=2)
            small = state.small_state()
            state.objects["loader"].next_batch()  # the donor's step goes on after the copy
            send_packed(comm, 1, pack_state(state, small))
            return small["objects"]["loader"]
        state = _job(CFG, 99, steps=0)
        recv_state(comm, 0, state)
        return state.objects["loader"].state_dict()
    sent, healed = run(fn, ranks=2)
    assert healed == sent


def test_a_replica_of_another_shape_is_refused_naming_the_first_difference():
    def fn(comm):
        if comm.rank == 0:
            state = _job(CFG, 7, steps=1)
            send_packed(comm, 1, pack_state(state, state.small_state()))
            return None
        state = _job(CFG.replace(d_model=16), 7, steps=0)
        with pytest.raises(HealFailed, match=r"does not fit this replica: first difference \('model/0.wte"
                                             r".weight', \[12, 8\]"):
            recv_state(comm, 0, state, who="member 3 (group 1)")
        return True
    assert run(fn, ranks=2)[1]
