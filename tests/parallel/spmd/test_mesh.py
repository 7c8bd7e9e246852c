"""The compiled SPMD program's mesh (minidist/parallel/spmd/mesh.py): the default shape, the devices of
every process in mesh order, and the meshes it refuses, with what would be right."""

from types import SimpleNamespace

import pytest

jax = pytest.importorskip("jax")

from minidist.parallel.spmd.mesh import default_shape, make_mesh, mesh_devices  # noqa: E402


@pytest.mark.parametrize("n,shape", [(1, (1, 1)), (2, (2, 1)), (3, (3, 1)), (4, (2, 2)), (6, (3, 2)),
                                     (8, (4, 2)), (16, (8, 2))])
def test_default_mesh_uses_every_device_with_tp_2_when_it_can(n, shape):
    assert default_shape(n) == shape


def test_a_mesh_larger_than_the_devices_is_refused_saying_how_many_jax_sees():
    with pytest.raises(ValueError, match="needs 16 devices, JAX sees 8"):
        make_mesh(4, 4)


def _fake_devices(procs, per):
    """Devices of ``procs`` processes, ``per`` each, listed out of order (process P-1 first)."""
    return [SimpleNamespace(process_index=p, id=1000 * p + i) for p in reversed(range(procs))
            for i in range(per)]


@pytest.mark.parametrize("procs,per,n,want", [
    (1, 8, 4, [0, 1, 2, 3]),
    (2, 8, 4, [0, 1, 1000, 1001]),            # each process its first n/P: not the first 4 (all process 0)
    (4, 2, 4, [0, 1000, 2000, 3000]),
    (2, 4, 8, [0, 1, 2, 3, 1000, 1001, 1002, 1003]),
])
def test_a_multi_process_mesh_takes_devices_from_every_process(monkeypatch, procs, per, n, want):
    monkeypatch.setattr(jax, "devices", lambda: _fake_devices(procs, per))
    monkeypatch.setattr(jax, "process_count", lambda: procs)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    assert [d.id for d in mesh_devices(n)] == want


def test_a_mesh_that_does_not_split_over_the_processes_is_refused(monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda: _fake_devices(2, 8))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with pytest.raises(ValueError, match="mesh of 3 devices does not split over 2 processes: on process 1"):
        mesh_devices(3)


def test_a_mesh_without_this_processs_devices_is_refused_naming_the_process(monkeypatch):
    """Such a process could run no part of the program; the first version crashed reading the loss."""
    devices = jax.devices()[:2]  # all on process 0
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with pytest.raises(ValueError, match="process 1 of 2: none of the mesh's 2 devices is its own"):
        make_mesh(2, 1, devices)
