"""Where the compiled SPMD program runs: its dp x tp mesh of JAX devices, and arrays placed on it.

The program itself is `minidist.parallel.spmd`; this is the host side it needs, apart from the
algorithm: the mesh a lesson uses when not told (`default_shape`), which devices it takes
(`mesh_devices`: n / P from each of P processes, so a multi-host mesh spans every host), the
``Mesh(('dp', 'tp'))`` in ``minidist.comm.Mesh``'s rank order (`make_mesh`: tp inner, inside one
host), and one global ``jax.Array`` from a host array (`global_array`: each process hands over only
its own devices' pieces). Multi-controller JAX, and why each rule is there: chapter 16
(lessons/16-tpu.md, "On a Cloud TPU VM, and on several hosts").
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import configure_jax


def _jax():
    return configure_jax()  # (x64, and full float32 matmuls: this program equals the eager run on a GPU too)


def default_shape(n: int) -> tuple[int, int]:
    """The (dp, tp) mesh a lesson uses when it is not told: every one of ``n`` devices, tp = 2 when
    n is even and at least 4, otherwise 1, and dp = n // tp. 1 -> 1x1, 2 -> 2x1, 3 -> 3x1, 4 -> 2x2,
    8 -> 4x2, 16 -> 8x2: tensor parallelism stays small (it all-reduces every layer, so it wants the
    fastest links, inside a host) and data parallelism takes the rest."""
    if n < 1:
        raise ValueError(f"a mesh needs at least one device, got n={n}")
    tp = 2 if n >= 4 and n % 2 == 0 else 1
    return n // tp, tp


def mesh_devices(n: int, devices=None) -> list:
    """The ``n`` devices a mesh uses, in mesh order. Of ``jax.devices()`` (every process's devices):
    each of the P processes contributes its first n / P local devices, ordered by process, then by
    id. So a multi-host mesh spans every host (``jax.make_mesh`` would take the first n devices, all
    on process 0 when n is smaller than the job, and the other processes would own none of the
    program); with one process it is simply the first n devices. ``devices``: an explicit list,
    used as it is (its first n)."""
    jax = _jax()
    if devices is not None:
        if n > len(devices):
            raise ValueError(f"mesh needs {n} devices, {len(devices)} were given")
        return list(devices[:n])
    everything = jax.devices()
    if n > len(everything):
        raise ValueError(f"mesh needs {n} devices, JAX sees {len(everything)}")
    procs = jax.process_count()
    if n % procs:
        raise ValueError(f"mesh of {n} devices does not split over {procs} processes: on process "
                         f"{jax.process_index()} use a multiple of {procs} devices")
    by_proc = {}
    for d in sorted(everything, key=lambda d: (d.process_index, d.id)):
        by_proc.setdefault(d.process_index, []).append(d)
    if any(len(local) < n // procs for local in by_proc.values()):
        raise ValueError(f"mesh of {n} devices needs {n // procs} on each of {procs} processes; "
                         f"they have {sorted(len(v) for v in by_proc.values())}")
    return [d for p in sorted(by_proc) for d in by_proc[p][:n // procs]]


def make_mesh(dp: int, tp: int, devices=None):
    """A ``Mesh(('dp', 'tp'))`` over ``mesh_devices(dp * tp)``: device dp_rank*tp + tp_rank, the
    order of ``minidist.comm.Mesh`` (rank = dp_rank * tp + tp_rank with pp = 1). tp is the inner
    axis, so a tp group sits inside one process (one host's fast links) whenever each process
    contributes a multiple of tp devices; dp crosses the hosts. When the mesh uses every device,
    ``mesh_utils.create_device_mesh`` orders it (what ``jax.make_mesh`` calls: on a TPU it follows
    the physical torus, elsewhere it keeps this order)."""
    jax = _jax()
    from jax.experimental import mesh_utils

    chosen = mesh_devices(dp * tp, devices)
    if not any(d.process_index == jax.process_index() for d in chosen):
        raise ValueError(f"process {jax.process_index()} of {jax.process_count()}: none of the mesh's "
                         f"{len(chosen)} devices is its own, so it could run no part of the program; "
                         "every process must contribute devices (mesh_devices takes n / P from each)")
    if devices is None and len(chosen) == jax.device_count():
        grid = mesh_utils.create_device_mesh((dp, tp), chosen)
    else:
        grid = np.array(chosen).reshape(dp, tp)
    return jax.sharding.Mesh(grid, ("dp", "tp"))


def global_array(a, sharding):
    """One global ``jax.Array`` laid out by ``sharding``, from a host array. JAX asks for the
    pieces of *this process's* devices only (``make_array_from_callback`` calls back with each
    one's index), so in a multi-host job each process hands over just its own batch rows -- what a
    data loader that reads only its shard would answer -- and its share of the parameters. Here
    every process holds the whole array (same seed, same values) and cuts its pieces out of it."""
    jax = _jax()
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])
