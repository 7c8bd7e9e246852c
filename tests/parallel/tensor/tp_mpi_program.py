"""Run under ``mpirun -n 2`` by test_tensor_parallel.py: ``python tp_mpi_program.py``.

Each process is one rank of a tp=2 group with sequence parallelism on (float64, dropout with the
serial twin's masks): its loss and, once gathered and unsharded, every gradient must equal the
serial GPT's, computed in each process. Prints "OK rank r" on success.
"""

import numpy as np
from test_tensor_parallel import TOL, serial_reference, tp_rank

from minidist.comm import run
from minidist.nn import GPTConfig
from minidist.parallel.tensor.gpt import TPGPT
from minidist.parallel.tensor.sharding import sharding_table, unshard


def check(comm):
    assert comm.transport == "mpi" and comm.size == 2, (comm.transport, comm.size)
    cfg = GPTConfig(vocab_size=8, block_size=8, n_layer=2, n_head=4, d_model=16, dropout=0.1,
                    dtype="float64", seed=3)
    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, cfg.vocab_size, (2, 6)), rng.integers(-1, cfg.vocab_size, (2, 6))
    _, loss, grads = serial_reference(cfg, idx, tgt)
    _, tp_loss, mine = tp_rank(comm, cfg, idx, tgt, sp=True)
    tp_grads = unshard(comm.allgather_obj(mine), sharding_table(TPGPT(cfg, comm)))
    assert tp_grads.keys() == grads.keys()
    diff = max(float(np.max(np.abs(tp_grads[n] - grads[n]))) for n in grads)
    assert abs(tp_loss - loss) < TOL["float64"] and diff < TOL["float64"], (tp_loss, loss, diff)
    print(f"OK rank {comm.rank} max abs grad diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    run(check)
