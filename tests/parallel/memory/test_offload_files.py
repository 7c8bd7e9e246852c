"""Offload survives crashes: space reserved up front, folders removed on SIGTERM, stale ones swept."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from minidist.nn import Linear
from minidist.parallel.memory import offload_files
from minidist.parallel.memory.offload import OffloadedAdamW

PREFIX = "minidist-adamw"


def params():
    return Linear(8, 4, rng=np.random.default_rng(0)).parameters()


def folders(root):
    return sorted(n for n in os.listdir(root) if n.startswith(PREFIX))


CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from minidist.nn import Linear
    from minidist.parallel.memory.offload import OffloadedAdamW
    opt = OffloadedAdamW(Linear(8, 4, rng=np.random.default_rng(0)).parameters(), sys.argv[1])
    print(opt.folder, flush=True)
    time.sleep(60)
""")


def start_child(root):
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, text=True)
    folder = p.stdout.readline().strip()
    assert folder and os.path.isdir(folder), "the child did not create its offload folder"
    return p, folder


def test_sigterm_removes_the_folder_and_still_dies_of_sigterm(tmp_path):
    p, folder = start_child(tmp_path)
    assert os.path.basename(folder).startswith(f"{PREFIX}-") and str(p.pid) in os.path.basename(folder)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    assert folders(tmp_path) == []


def test_folder_of_a_killed_process_is_swept_by_the_next_optimizer(tmp_path):
    p, folder = start_child(tmp_path)
    p.kill()  # SIGKILL: no handler runs, the folder stays behind
    p.wait(timeout=30)
    assert folders(tmp_path) == [os.path.basename(folder)]
    host = offload_files._host()
    alive = tmp_path / f"{PREFIX}-{host}-{os.getppid()}-keep"   # owner still running: kept
    other = tmp_path / f"{PREFIX}-otherhost-{p.pid}-keep"       # another host's pid: never judged here
    unrelated = tmp_path / "notes"
    for d in (alive, other, unrelated):
        d.mkdir()
    with OffloadedAdamW(params(), tmp_path) as opt:
        mine = os.path.basename(opt.folder)
        assert not os.path.exists(folder)
        assert sorted(folders(tmp_path)) == sorted([alive.name, other.name, mine])
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, other.name, "notes"])


def test_owner_is_read_back_from_the_name():
    assert offload_files.owner_of(f"{PREFIX}-node_1-4242-ab_c", PREFIX) == ("node_1", 4242)
    assert offload_files.owner_of(f"{PREFIX}-4242", PREFIX) is None
    assert offload_files.owner_of("other-node-4242-x", PREFIX) is None


def test_full_disk_is_a_clear_error_at_creation(tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(OSError) as info:
        OffloadedAdamW(params(), tmp_path)
    assert info.value.errno == errno.ENOSPC
    msg = str(info.value)
    assert "no room" in msg and f"needs {4 * 8 * 4:,} bytes" in msg and "offload_dir" in msg
    assert os.listdir(tmp_path) == []  # nothing half-made is left


def test_space_is_reserved_not_sparse(tmp_path):
    shape = (256, 1024)  # 1 MiB of float32
    m = offload_files.reserved_memmap(str(tmp_path / "x"), np.float32, shape)
    st = os.stat(tmp_path / "x")
    assert st.st_size == 4 * 256 * 1024
    assert st.st_blocks * 512 >= st.st_size  # blocks on disk for every byte: no SIGBUS later
    assert m.shape == shape and not m.any()


ABORTING = textwrap.dedent("""
    import sys, time
    import numpy as np
    from minidist.comm import run
    from minidist.nn import Linear
    from minidist.parallel.memory.offload import OffloadedAdamW

    def body(comm):
        opt = OffloadedAdamW(Linear(8, 4, rng=np.random.default_rng(0)).parameters(), sys.argv[1])
        comm.barrier()
        if comm.rank == 1:
            raise RuntimeError("rank 1 fails: the job is aborted")
        time.sleep(60)

    run(body)
""")


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
def test_folders_of_an_aborted_mpi_job_are_swept_by_the_next_optimizer(tmp_path):
    r = subprocess.run(["mpirun", "-n", "2", sys.executable, "-c", ABORTING, str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    # MPI_Abort ends the failing rank and kills its peer: no Python cleanup runs on either
    left = folders(tmp_path)
    assert 1 <= len(left) <= 2
    pids = [offload_files.owner_of(n, PREFIX)[1] for n in left]
    deadline = time.monotonic() + 30  # the launcher may return before the killed ranks are reaped
    while any(offload_files.pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    with OffloadedAdamW(params(), tmp_path) as opt:
        assert folders(tmp_path) == [os.path.basename(opt.folder)]
    assert folders(tmp_path) == []
