"""Converting between a full (serial) model's state_dict and its tensor-parallel shards.

``sharding_table(model)`` collects the layers' ``param_shards`` declarations (``shard.py``) into
one table, ``{name: Shard | None}`` under the names of ``model.named_parameters()``; everything
here reads that table and nothing else (no rules on names):

    shard_state_dict(full_sd, table, rank, size)  # full arrays -> this rank's shards
    unshard(shards, table)                        # every rank's shards (rank order) -> full arrays
    reshard(shards, table, new_size)              # shards for ``size`` ranks -> for ``new_size``
    load_shard(module, full_sd, rank, size)       # a sharded module loads its part of a full one
    serial_state_dict(model)                      # a TPGPT's serial state_dict, on every rank

Arrays are host NumPy arrays; a Shard's ``group`` names the mesh axis whose ranks share the
parameter ("tp"), so a table can hold several groups and the functions convert one at a time.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from minidist.accel.backend import to_host
from minidist.parallel.tensor.shard import (  # noqa: F401  (importable from here too)
    COLUMNS,
    ROWS,
    Shard,
    kv_heads_split,
    kv_of_local_heads,
    local_kv_heads,
    split_columns,
    split_rows,
)


def sharding_table(model, prefix: str = "") -> OrderedDict:
    """``{parameter name: Shard or None (replicated)}`` for every parameter of ``model``, in
    ``named_parameters`` order, read from each module's ``param_shards`` declaration.
    ``prefix`` is put before every name (e.g. ``"3."``: a pipeline stage's layer 3)."""
    declared = {}
    for mprefix, mod in model.named_modules(prefix):
        for pname, shard in getattr(mod, "param_shards", {}).items():
            if pname not in mod._params:
                raise ValueError(f"{type(mod).__name__} declares a sharding for {pname!r}, which is not one "
                                 f"of its parameters {list(mod._params)}")
            declared[mprefix + pname] = shard
    return OrderedDict((name, declared.get(name)) for name, _ in model.named_parameters(prefix))


def _host(a) -> np.ndarray:
    return to_host(a) if hasattr(a, "shape") else np.asarray(a)


def _shard_of(table, name: str, group: str):
    if name not in table:
        raise KeyError(f"{name!r} is not in the sharding table (which has {list(table)[:4]}...): "
                       f"build the table from the same model as the state_dict")
    shard = table[name]
    return shard if shard is not None and shard.group == group else None


def shard_state_dict(full_sd: dict, table: dict, rank: int, size: int, group: str = "tp") -> OrderedDict:
    """Rank ``rank``'s (of ``size`` in ``group``) part of every array of a full state_dict."""
    out = OrderedDict()
    for name, a in full_sd.items():
        host, shard = _host(a), _shard_of(table, name, group)
        out[name] = host if shard is None else np.ascontiguousarray(shard.split(host, rank, size, name))
    return out


def unshard(shards: list, table: dict, group: str = "tp") -> OrderedDict:
    """The full state_dict from every rank's state_dict of ``group`` (``shards[r]``: rank r's)."""
    out = OrderedDict()
    for name in shards[0]:
        parts = [_host(s[name]) for s in shards]
        shard = _shard_of(table, name, group)
        out[name] = parts[0] if shard is None else shard.concat(parts)
    return out


def load_shard(module, full_sd: dict, rank: int, size: int, group: str = "tp"):
    """Load into the sharded ``module`` its part (rank ``rank`` of ``size``) of the full state_dict
    ``full_sd`` (e.g. its serial twin's), by the module's own sharding table. Returns the module."""
    return module.load_state_dict(shard_state_dict(full_sd, sharding_table(module), rank, size, group))


def reshard(shards: list, table: dict, new_size: int, group: str = "tp") -> list:
    """State_dicts sharded over ``len(shards)`` ranks of ``group`` -> over ``new_size`` ranks."""
    full = unshard(shards, table, group)
    return [shard_state_dict(full, table, r, new_size, group) for r in range(new_size)]


def serial_state_dict(model) -> OrderedDict:
    """The serial model's state_dict, assembled on every rank of ``model.comm`` (a TPGPT) from its
    shards (small models: a pickled all-gather)."""
    local = OrderedDict((k, _host(a)) for k, a in model.state_dict().items())
    return unshard(model.comm.allgather_obj(local), sharding_table(model))


def load_serial_state_dict(model, serial_sd: dict):
    """Load into ``model`` (a TPGPT) this rank's part of the serial model's state_dict."""
    return load_shard(model, serial_sd, model.comm.rank, model.comm.size)
