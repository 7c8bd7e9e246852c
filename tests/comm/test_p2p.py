"""Point-to-point, split, object helpers and the mesh on the threads transport."""

import numpy as np
import pytest

from minidist.comm import Mesh, all_reduce, run


def test_send_recv_learns_shape_and_dtype_and_fills_out():
    def body(comm):
        if comm.rank == 0:
            comm.send(np.arange(6, dtype=np.int16).reshape(2, 3), 1, tag=5)
            comm.send(np.ones(4, np.float32), 1, tag=6)
            return None
        a = comm.recv(0, tag=5)
        out = np.zeros(4, np.float32)
        b = comm.recv(0, tag=6, out=out)
        return a, b is out, out.tolist()

    a, same, vals = run(body, ranks=2)[1]
    assert a.dtype == np.int16 and a.shape == (2, 3) and a[1, 2] == 5
    assert same and vals == [1.0] * 4


def test_irecv_matches_in_posted_order_and_sendrecv_ring():
    def body(comm):
        p, r = comm.size, comm.rank
        reqs = [comm.irecv((r - 1) % p, tag=1) for _ in range(3)]
        for k in range(3):
            comm.isend(np.array([r, k]), (r + 1) % p, tag=1).wait()
        got = [q.wait().tolist() for q in reqs]
        ring = comm.sendrecv(np.array([r]), (r + 1) % p, (r - 1) % p)
        return got, ring.tolist()

    for r, (got, ring) in enumerate(run(body, ranks=3)):
        assert got == [[(r - 1) % 3, k] for k in range(3)]
        assert ring == [(r - 1) % 3]


def test_split_and_object_helpers():
    def body(comm):
        sub = comm.split(comm.rank % 2, key=-comm.rank)  # reverse order inside each group
        none = comm.split(None if comm.rank == 0 else 1, 0)
        s = all_reduce(sub, np.array([comm.rank]))
        return (sub.rank, sub.size, int(s[0]), none is None, comm.bcast_obj({"a": comm.rank}, root=2),
                comm.allgather_obj(comm.rank * 10), comm.gather_obj(comm.rank, root=1))

    out = run(body, ranks=5)
    assert [o[:3] for o in out] == [(2, 3, 6), (1, 2, 4), (1, 3, 6), (0, 2, 4), (0, 3, 6)]
    assert [o[3] for o in out] == [True, False, False, False, False]
    assert all(o[4] == {"a": 2} and o[5] == [0, 10, 20, 30, 40] for o in out)
    assert out[1][6] == [0, 1, 2, 3, 4] and out[0][6] is None


def test_mesh_rank_order_and_groups():
    def body(comm):
        m = Mesh(comm, dp=2, pp=2, tp=2)
        assert m.rank_of(m.pp_rank, m.dp_rank, m.tp_rank) == comm.rank
        members = [g.allgather_obj(comm.rank) for g in (m.tp, m.dp, m.pp)]
        return (m.pp_rank, m.dp_rank, m.tp_rank), members

    out = run(body, ranks=8)
    assert out[5][0] == (1, 0, 1)  # 5 = (1*2 + 0)*2 + 1
    assert out[5][1] == [[4, 5], [5, 7], [1, 5]]


def test_bad_input_errors_name_the_rank():
    with pytest.raises(ValueError, match=r"dp=2 x pp=1 x tp=2 = 4 ranks, but the world has 6"):
        run(lambda comm: Mesh(comm, dp=2, tp=2), ranks=6)
    with pytest.raises(ValueError, match=r"meshes of different sizes \(rank 0: dp=2 pp=1 tp=2, rank 1: dp=4 "
                                         r"pp=1 tp=1, .*every rank must pass the same dp, pp and tp"):
        run(lambda comm: Mesh(comm, dp=2, tp=2) if comm.rank == 0 else Mesh(comm, dp=4), ranks=4)
    with pytest.raises(ValueError, match=r"rank 0: dest=3 is not a rank .*0\.\.1"):
        run(lambda comm: comm.send(np.ones(1), 3), ranks=2)
    with pytest.raises(ValueError, match=r"received float64\[3\] from rank 0 into a buffer of float64\[4\]"):
        run(lambda comm: comm.send(np.ones(3), 1) if comm.rank == 0 else comm.recv(0, out=np.ones(4)),
            ranks=2)


def test_exception_on_one_rank_is_reraised_with_its_rank_and_others_do_not_hang():
    def body(comm):
        if comm.rank == 2:
            raise KeyError("boom")
        return comm.recv((comm.rank + 1) % comm.size)  # would wait forever

    with pytest.raises(KeyError, match="boom") as info:
        run(body, ranks=4)
    assert "raised on rank 2 of 4" in "".join(info.value.__notes__)


def test_bfloat16_travels_with_its_dtype():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from minidist.comm import all_gather

    x = np.arange(5).astype(ml_dtypes.bfloat16)

    def body(comm):
        y = comm.recv(0) if comm.rank == 1 else comm.send(x, 1)
        return y, all_gather(comm, x), all_reduce(comm, x, algorithm="ring")

    y, g, s = run(body, ranks=2)[1]
    assert y.dtype == x.dtype and (y == x).all()
    assert g.dtype == x.dtype and g.shape == (10,)
    assert s.dtype == x.dtype and s.astype(float).tolist() == [0, 2, 4, 6, 8]
