"""Converting between the serial GPT's state_dict and the TP GPT's shards, by the layers' declarations."""

import numpy as np

from minidist.comm import run
from minidist.nn import GPT, GPTConfig
from minidist.parallel.tensor.gpt import TPGPT
from minidist.parallel.tensor.shard import Shard
from minidist.parallel.tensor.sharding import (
    load_serial_state_dict,
    reshard,
    serial_state_dict,
    shard_state_dict,
    sharding_table,
    unshard,
)


def gpt_table(cfg, tp=2):
    """The TP GPT's sharding table (the same for every rank and tp size)."""
    return run(lambda comm: sharding_table(TPGPT(cfg, comm)), ranks=tp)[0]


def test_state_dict_round_trip_and_loading():
    cfg = GPTConfig(vocab_size=8, block_size=6, n_layer=2, n_head=2, d_model=8, dtype="float64", seed=3)
    serial = GPT(cfg).state_dict()
    table = gpt_table(cfg)
    shards = [shard_state_dict(serial, table, r, 2) for r in range(2)]
    back = unshard(shards, table)
    assert all(np.array_equal(back[k], serial[k]) for k in serial)

    def rank(comm):
        model = TPGPT(cfg.replace(seed=99), comm)   # different init, then load the serial weights
        load_serial_state_dict(model, serial)
        fresh = TPGPT(cfg, comm).state_dict()       # sharded init == sharded serial state_dict
        same = all(np.array_equal(fresh[k], v) for k, v in model.state_dict().items())
        return same, serial_state_dict(model)

    for same, sd in run(rank, ranks=2):
        assert same and all(np.array_equal(sd[k], serial[k]) for k in serial)


def test_sharding_table_is_declared_by_the_layers():
    """The table, written out by hand for a one-layer GPT: what each layer declares, nothing else."""
    cfg = GPTConfig(vocab_size=8, block_size=6, n_layer=1, n_head=2, d_model=8, dtype="float64")
    rows, cols, qkv_w, qkv_b = Shard(0), Shard(1), Shard(1, blocks=3), Shard(0, blocks=3)
    assert dict(gpt_table(cfg)) == {
        "0.wte.weight": rows, "0.wpe.weight": None,
        "1.ln1.weight": None, "1.ln1.bias": None,
        "1.attn.qkv.weight": qkv_w, "1.attn.qkv.bias": qkv_b,
        "1.attn.proj.weight": rows, "1.attn.proj.bias": None,
        "1.ln2.weight": None, "1.ln2.bias": None,
        "1.mlp.fc.weight": cols, "1.mlp.fc.bias": rows,
        "1.mlp.proj.weight": rows, "1.mlp.proj.bias": None,
        "2.ln.weight": None, "2.ln.bias": None, "2.proj.weight": cols}


def test_reshard_two_ranks_to_four_equals_sharding_the_full_model():
    cfg = GPTConfig(vocab_size=8, block_size=6, n_layer=2, n_head=4, d_model=8, dtype="float64", seed=5)
    full, table = GPT(cfg).state_dict(), gpt_table(cfg)
    two = [shard_state_dict(full, table, r, 2) for r in range(2)]
    four = reshard(two, table, 4)
    for r in range(4):
        direct = shard_state_dict(full, table, r, 4)
        assert all(np.array_equal(four[r][k], direct[k]) for k in full)
    loaded = run(lambda comm: TPGPT(cfg, comm).state_dict(), ranks=4)  # tp=4's own init: the same parts
    assert all(np.array_equal(loaded[r][k], four[r][k]) for r in range(4) for k in full)
