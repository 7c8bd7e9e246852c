"""The JAX device transport: ranks as threads bound to JAX devices (8 forced CPU devices in
tests), point-to-point arrays moved device to device, everything else as on the threads transport."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from minidist.accel.backend import JaxBackend  # noqa: E402
from minidist.comm import all_reduce, measure, run  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.parallel.three_d import gather_full_state, max_state_diff, train_3d, train_serial  # noqa: E402


def test_point_to_point_moves_device_to_device_without_the_host(monkeypatch):
    def no_host(self, x):
        raise AssertionError("a point-to-point JAX array went through the host")
    monkeypatch.setattr(JaxBackend, "to_host", no_host)
    monkeypatch.setattr(JaxBackend, "from_host", no_host)
    devices = jax.devices()

    def body(comm):
        x = jax.device_put(np.arange(6.0).reshape(2, 3) + comm.rank, devices[comm.rank])
        got = comm.sendrecv(x, (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size)
        return comm.transport, np.asarray(got), list(got.devices())

    out = run(body, ranks=4, transport="jax")
    for r, (transport, got, devs) in enumerate(out):
        assert transport == "jax"
        assert devs == [devices[r]]  # it lives on the receiver's device, not the sender's
        np.testing.assert_array_equal(got, np.arange(6.0).reshape(2, 3) + (r - 1) % 4)


def test_ledger_counts_the_ring_formula_and_the_payload():
    n, p = 1000, 4

    def body(comm):
        x = comm.backend.from_host(np.full(n, float(comm.rank + 1)))
        with measure(comm) as m:
            y = all_reduce(comm, x, algorithm="ring")
            comm.send(x, (comm.rank + 1) % p) if comm.rank % 2 == 0 else comm.recv((comm.rank - 1) % p)
        return np.asarray(y), m.bytes_sent, type(y).__module__

    for r, (y, sent, mod) in enumerate(run(body, ranks=p, transport="jax")):
        np.testing.assert_array_equal(y, np.full(n, 10.0))  # 1+2+3+4
        assert mod.startswith(("jax", "jaxlib"))
        ring = 2 * (p - 1) * (n // p) * 8  # 2(p-1)/p * N elements of float64
        assert sent == ring + (n * 8 if r % 2 == 0 else 0)


def test_refuses_a_numpy_backend_naming_the_rank():
    with pytest.raises(ValueError, match="rank 0: the jax device transport needs backend='jax'"):
        run(lambda comm: None, ranks=1, transport="jax", backend="numpy")


CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, d_model=8, dtype="float64")


def test_3d_training_on_devices_equals_the_serial_twin():
    """pp=2 x tp=2 on 4 devices: activations and gradients cross devices between the stages, the
    tp collectives run unchanged; parameters equal the serial twin's within 1e-9 (float64).
    (8 ranks, dp=2 x pp=2 x tp=2, passes too, but JAX compiles every op once per device: 30+ s.)"""
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 16, (4, 4)), rng.integers(0, 16, (4, 4)))]
    want, want_losses = train_serial(CFG, batches, lr=0.1, optimizer="adamw")

    def body(comm):
        res = train_3d(comm, CFG, batches, dp=1, pp=2, tp=2, microbatches=2, lr=0.1, optimizer="adamw")
        devs = {str(d) for p in res.stage.parameters() for d in p.data.devices()}
        return gather_full_state(comm, res), res.losses, devs

    out = run(body, ranks=4, transport="jax")
    state, losses, _ = out[0]
    assert max_state_diff(state, want) <= 1e-9
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-9)
    for r, (_, _, devs) in enumerate(out):
        assert devs == {str(jax.devices()[r])}


def test_multihost_initialize_agrees_on_rank_0s_address():
    import socket

    from minidist.comm.transports.devices import jax_distributed_init

    def body(comm):
        seen = []
        address = jax_distributed_init(comm, port=1234, initialize=lambda *a, **k: seen.append((a, k)))
        return address, seen

    for r, (address, seen) in enumerate(run(body, ranks=3)):  # threads stand in for mpirun's ranks
        assert address == f"{socket.gethostname()}:1234"
        assert seen == [((address,), {"num_processes": 3, "process_id": r})]


def test_multihost_coordinator_port_is_free_or_the_one_asked_for(monkeypatch):
    """No port given: rank 0 picks one free on its host (two jobs on one machine must not both
    take 8476) and every rank gets that one; ``MINIDIST_JAX_PORT`` chooses it."""
    import socket

    from minidist.comm.transports.devices import jax_distributed_init

    def addresses():
        return [a for a in run(lambda comm: jax_distributed_init(comm, initialize=lambda *a, **k: None),
                               ranks=3)]

    monkeypatch.delenv("MINIDIST_JAX_PORT", raising=False)
    with socket.socket() as busy:  # another job's coordinator on the old fixed port
        try:
            busy.bind(("", 8476))
            busy.listen()
        except OSError:
            pass  # someone already holds it: busy all the same
        got = addresses()
    assert len(set(got)) == 1
    port = int(got[0].rsplit(":", 1)[1])
    assert port != 8476
    with socket.socket() as s:
        s.bind(("", port))  # nothing holds it: the coordinator can
    monkeypatch.setenv("MINIDIST_JAX_PORT", "4321")
    assert addresses() == [f"{socket.gethostname()}:4321"] * 3


@pytest.mark.gpu
def test_cupy_point_to_point_lands_on_the_receivers_gpu():
    cupy = pytest.importorskip("cupy")
    n = cupy.cuda.runtime.getDeviceCount()

    def body(comm):
        x = cupy.full(5, float(comm.rank))
        got = comm.sendrecv(x, (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size)
        return int(got.device.id), cupy.asnumpy(got)

    for r, (dev, got) in enumerate(run(body, ranks=2, transport="cupy")):
        assert dev == r % n
        np.testing.assert_array_equal(got, np.full(5, float((r - 1) % 2)))


def test_cupy_move_across_gpus_orders_both_streams_around_the_copy(monkeypatch):
    """No GPU here: a stand-in ``cupy`` module records what ``CupyDeviceComm.move`` asks of CUDA.
    Across GPUs the copy goes on the receiver's stream, so an event recorded on the sender's
    stream must be waited for first, and the sender's stream must wait for an event recorded after
    the copy (else it may overwrite ``x`` mid-copy); on one GPU (ranks sharing it) a plain copy."""
    import contextlib
    import sys
    import types

    from minidist.comm.transports.jaxdev import CupyDeviceComm

    log, current = [], [0]

    class Stream:
        def record(self):
            log.append(("record on", current[0]))
            return f"event@{current[0]}"

        def wait_event(self, event):
            log.append(("wait on", current[0], event))

    @contextlib.contextmanager
    def device(i):
        before, current[0] = current[0], i
        yield
        current[0] = before

    class Array:
        def __init__(self, dev):
            self.device = types.SimpleNamespace(id=dev)

    def array(x, copy):
        log.append(("copy on", current[0], x.device.id))
        return Array(current[0])

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=device, get_current_stream=Stream,
                                   runtime=types.SimpleNamespace(getDeviceCount=lambda: 2)),
        array=array, ascontiguousarray=lambda x: (log.append(("contiguous on", current[0])), x)[1])
    monkeypatch.setitem(sys.modules, "cupy", fake)
    comm = object.__new__(CupyDeviceComm)  # move() needs no group: only device_of and cupy
    got = comm.move(Array(0), world_rank=1)  # GPU 0 -> GPU 1
    assert got.device.id == 1 and current[0] == 0
    assert log == [("contiguous on", 0), ("record on", 0), ("wait on", 1, "event@0"), ("copy on", 1, 0),
                   ("record on", 1), ("wait on", 0, "event@1")]  # the sender's stream waits for the copy
    log.clear()
    assert comm.move(Array(0), world_rank=2).device.id == 0  # rank 2 shares GPU 0: one stream, no event
    assert log == [("copy on", 0, 0)]
