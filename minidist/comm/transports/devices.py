"""Bind each rank to a device of its backend: JAX device ``rank % n``, CuPy GPU ``rank % n``.

With JAX on a CPU the devices are forced with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(set before JAX is imported); on a TPU VM each core is a device, one rank each.
"""

from __future__ import annotations

from minidist.accel.backend import Backend, get_backend


def describe_binding(backend: Backend, size: int, transport: str) -> str:
    """One line for a lesson's header: the transport, the backend and the device each rank is bound
    to by ``bind_backend``'s rule (computed here, no message sent)."""
    head = f"{size} rank{'s' if size != 1 else ''} ({transport}), backend {backend.name}"
    if backend.name == "numpy":
        return head + " on the host CPU"
    if backend.name == "jax":
        import jax

        devices = jax.devices()
        return head + ": " + ", ".join(f"rank {r} -> {devices[r % len(devices)]}" for r in range(size))
    if backend.name == "cupy":
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        return head + ": " + ", ".join(f"rank {r} -> GPU {r % n}" for r in range(size))
    return head


def bind_backend(backend, rank: int) -> Backend:
    """The Backend rank ``rank`` computes with (NumPy has no device; JAX/CuPy get ``rank % n``)."""
    if isinstance(backend, Backend):
        return backend
    name = get_backend(backend).name  # validates the name, applies MINIDIST_BACKEND
    if name == "jax":
        import jax

        devices = jax.devices()
        return get_backend("jax", device=devices[rank % len(devices)])
    if name == "cupy":
        import cupy

        gpu = rank % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(gpu).use()  # current device is per thread: set it in this rank's thread
        return get_backend("cupy", device=gpu)
    return get_backend(name)


def free_port() -> int:
    """A TCP port nothing on this host listens on now (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def jax_distributed_init(comm, port: int | None = None, initialize=None) -> str:
    """Multi-host JAX under ``mpirun``: rank 0 names itself the coordinator (its host name and
    ``port``: ``$MINIDIST_JAX_PORT``, else a port free on its host now, so two jobs on one machine
    don't collide), every rank learns that address over ``comm`` (MPI), and each calls
    ``jax.distributed.initialize(address, num_processes=comm.size, process_id=comm.rank)``.
    After it ``jax.devices()`` lists every host's devices. Returns the address. (``initialize``:
    the function to call, for tests.)"""
    import os
    import socket

    address = None
    if comm.rank == 0:
        port = port or int(os.environ.get("MINIDIST_JAX_PORT") or free_port())
        address = f"{socket.gethostname()}:{port}"
    address = comm.bcast_obj(address, root=0)
    if initialize is None:
        import jax

        initialize = jax.distributed.initialize
    initialize(address, num_processes=comm.size, process_id=comm.rank)
    return address
