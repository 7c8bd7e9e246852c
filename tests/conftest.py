"""Test set-up: one BLAS thread per process, hypothesis profiles, the slow set, the gpu and mpi
markers' skip rules, and a short watchdog: a hung collective fails a test in seconds, never shrunk
by hypothesis."""

import functools
import os
import shutil

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MINIDIST_TIMEOUT", "20")  # tests only: a hang fails in 20 s, not the 300 s default
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tests assume 8 CPU devices, also on a GPU or TPU machine

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.database import DirectoryBasedExampleDatabase  # noqa: E402

# ci (the default): derandomized, so every run (and every MPI rank) draws the same examples.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=10,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# explore (HYPOTHESIS_PROFILE=explore): random draws, 200 examples per test (tests that set their
# own count through `budget` get at least that), failures saved in .hypothesis/ and replayed first.
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=200,
                          database=DirectoryBasedExampleDatabase(".hypothesis/examples"),
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
EXPLORE = os.environ.get("HYPOTHESIS_PROFILE") == "explore"


def budget(max_examples: int, **kw) -> settings:
    """``@budget(n)`` instead of ``@settings(max_examples=n)`` on a slow property test: n examples
    under ci, but under explore the profile's random draws, count and example database win."""
    if EXPLORE:
        kw = {k: v for k, v in kw.items() if k not in ("derandomize", "database")}
        return settings(max_examples=max(max_examples, settings.default.max_examples), **kw)
    return settings(max_examples=max_examples, **kw)


@functools.cache
def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# The slow set: `python -m pytest -q -m slow` (the default command leaves it out: pyproject's addopts;
# `.ci/run` runs both). Each entry is a node-id prefix and why it is slow; every `mpi` test (a real
# `mpirun` launch, seconds each) is in it too, and the `timing` tests: a wall-clock ceiling or a
# process-wide counter that another program's load can push past, so CI runs them, a busy laptop need not.
SLOW = {
    "tests/autograd/test_ops.py[jax]": "a JAX compile of forward and backward for every shape drawn",
    "tests/autograd/test_fused.py[jax]": "a JAX compile of forward and backward for every shape drawn",
    "tests/parallel/spmd/test_program.py::test_the_program_equals_the_eager_run_on_the_device_transport":
        "compiles both",
    "tests/parallel/spmd/test_program.py::test_the_compiled_program_multiplies_float32_in_full_precision":
        "a new process",
    "tests/accel/test_jax_cache.py::test_two_writers_at_once": "three processes compiling a GPT",
    "tests/accel/test_jax_cache.py::test_cache_off_writes_nothing": "a new process compiling a GPT",
    "tests/resilience/test_supervisor.py::test_supervised_job_recovers": "jobs killed and restarted",
    "tests/resilience/test_supervisor.py::test_elastic_restart_on_fewer_ranks": "a job restarted",
    "tests/resilience/test_supervisor.py::test_a_hung_rank_is_detected": "waits for a heartbeat timeout",
    "tests/resilience/test_supervisor.py::test_giving_up_after_max_restarts": "jobs restarted",
    "tests/resilience/test_jobs.py::test_a_sigkilled_supervisor_leaves_no_rank_and_the_next_job":
        "three lesson jobs, one SIGKILLed (test_supervisor_signals and test_folder's sweep stay)",
    "tests/test_conftest.py::test_the_default_command_leaves_out": "two child pytests",
    # JAX compiling a model's every op (seconds each with empty caches): the default set keeps
    # tests/accel/test_jax_engine.py's model checks, these repeat them for other techniques
    "tests/parallel/context/test_ring.py::test_compiled_ring_steps_equal_the_eager_steps": "JAX",
    "tests/parallel/context/test_ring.py::test_packed_ring_attention_equals_packed_attention[jax]": "JAX",
    "tests/parallel/balance/test_dp.py::test_dp_on_jax_pads_shares": "JAX",
    "tests/accel/test_jax_engine.py::test_slices_differing_in_start_stop_or_step": "JAX, 6 examples",
    "tests/accel/test_jax_engine.py::test_three_adamw_steps_of_a_gpt_on_jax": "JAX",
    "tests/parallel/memory/test_fp8.py::test_the_fp8_layer_on_jax_arrays_equals_numpy": "JAX",
    "tests/infer/test_quant_kv.py::test_int8_and_prefix_caches_on_jax": "JAX",
    "tests/infer/test_infer.py::test_cache_works_on_jax_too": "JAX",
    "tests/infer/test_buckets.py::test_bucketed_jax_decoding_equals_numpys": "JAX",
    "tests/parallel/data/test_zero.py::test_ddp_and_zero3_on_jax": "JAX",
}
TIMING = {
    "tests/parallel/tensor/test_tensor_parallel.py::test_vocab_parallel_loss_compiles_once":
        "JAX compiles of a vocab-parallel loss on 2 thread ranks",
}


def _listed(item, table) -> bool:
    """``item`` matches a prefix of ``table``; ``path[jax]`` is every item of path whose backend is jax."""
    backend = getattr(getattr(item, "callspec", None), "params", {}).get("backend")
    path = item.nodeid.split("::")[0]
    return any(item.nodeid.startswith(key) or key == f"{path}[{backend}]" for key in table)


def _names_a_file(config) -> bool:
    """Naming a test file or node (``pytest tests/comm/test_mpirun.py``) without ``-m``: the run is
    all of that file, its slow tests too (the slow set is left out of whole folders only)."""
    args = config.invocation_params.args
    if any(a.startswith(("-m", "--markexpr")) for a in args):
        return False
    return any(a.split("::")[0].endswith(".py") for a in args if not a.startswith("-"))


def pytest_configure(config):
    if _names_a_file(config):
        config.option.markexpr = ""


MOST_WORKERS = 4  # each worker imports minidist and JAX and compiles its own programs


@pytest.hookimpl(tryfirst=True)  # before xdist's own (one per core), also when loaded with -p
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): the default set runs in one worker per core (at most
    MOST_WORKERS) -- its tests hold no wall-clock ceiling, so sharing the cores changes no outcome.
    Anything that may hold slow tests (``-m slow``, ``-m ""``, a file named) runs in this process
    alone: real mpirun jobs oversubscribe the cores by themselves and the timing tests measure
    wall time."""
    if _names_a_file(config) or config.option.markexpr != "not slow":
        return 0
    return max(1, min(MOST_WORKERS, len(os.sched_getaffinity(0))))


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _listed(item, TIMING):
            item.add_marker(pytest.mark.timing)
        if "mpi" in item.keywords or "timing" in item.keywords or _listed(item, SLOW):
            item.add_marker(pytest.mark.slow)
    if shutil.which("mpirun") is None and os.environ.get("MINIDIST_REQUIRE_MPI") != "1":
        for item in items:  # mpi tests: skipped with the reason (or failed in setup when CI requires them)
            if "mpi" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs mpirun on PATH (pip install mpich)"))
    if _has_gpu() or os.environ.get("MINIDIST_REQUIRE_GPU") == "1":
        return  # gpu tests run (and fail in setup below when no GPU is there)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs CuPy and an NVIDIA GPU"))


def pytest_runtest_setup(item):
    # a fixture added by a marker at collection time is never requested, so fail here instead
    if "gpu" in item.keywords and not _has_gpu():  # only with MINIDIST_REQUIRE_GPU=1
        pytest.fail("MINIDIST_REQUIRE_GPU=1 but no NVIDIA GPU with CuPy is available")
    if "mpi" in item.keywords and shutil.which("mpirun") is None:  # only with MINIDIST_REQUIRE_MPI=1
        pytest.fail("MINIDIST_REQUIRE_MPI=1 but mpirun is not on PATH (pip install mpich)")


def _unused_mpich_segments(older_than: float = 10.0) -> list[str]:
    """MPICH's shared-memory files in /dev/shm that are ours, older than ``older_than`` seconds and
    neither mapped nor open in any process: what a job whose ranks were killed (the watchdog and
    failure tests kill them on purpose) leaves behind. In a container /dev/shm is often 64 MB, and
    once it is full MPICH's next job dies of SIGBUS."""
    import time

    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")]
    except OSError:
        return []
    now, uid = time.time(), os.getuid()
    old = set()
    for n in names:
        try:
            st = os.stat(f"/dev/shm/{n}")
        except OSError:
            continue
        if st.st_uid == uid and now - st.st_mtime > older_than:
            old.add(f"/dev/shm/{n}")
    if not old:
        return []
    for pid in filter(str.isdigit, os.listdir("/proc")):  # what any process still maps or holds open
        try:
            with open(f"/proc/{pid}/maps") as f:
                old -= {line.split(maxsplit=5)[-1].strip() for line in f if "/dev/shm/mpich_shm_" in line}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                old.discard(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return sorted(old)


def pytest_sessionfinish(session, exitstatus):
    for path in _unused_mpich_segments():
        try:
            os.unlink(path)
        except OSError:
            pass


@pytest.fixture(autouse=True)
def _hangs_do_not_shrink(request, monkeypatch):
    """In a hypothesis test the watchdog raises ``RanksHung`` (a BaseException): hypothesis stops at
    the first hung example instead of shrinking it at MINIDIST_TIMEOUT seconds a try."""
    if not getattr(request.function, "is_hypothesis_test", False):
        return
    from minidist.comm.watchdog import Watched
    from minidist.grading import RanksHung

    timeout_error = Watched.timeout_error
    monkeypatch.setattr(Watched, "timeout_error",
                        lambda comm, what, waited: RanksHung(str(timeout_error(comm, what, waited))))


def backends():
    """Backends every op test runs on: numpy and jax (when installed), cupy on GPU machines."""
    out = ["numpy"]
    try:
        import jax  # noqa: F401

        out.append("jax")
    except ImportError:
        pass
    out.append(pytest.param("cupy", marks=pytest.mark.gpu))
    return out


CLOCK_ENV = ("MINIDIST_CLOCK", "MINIDIST_LINK", "MINIDIST_DEVICE")


@pytest.fixture(autouse=True)
def _each_test_starts_on_the_wall_clock():
    """A lesson's ``use_clock`` puts ``--clock``/``--link``/``--device`` into the environment and the
    link module for the ranks it starts; run in-process, they would outlive its test, and the next
    test in that worker would time itself on an emulated H100. Restored after every test."""
    from minidist.comm.transports.link import set_link

    saved = {k: os.environ.get(k) for k in CLOCK_ENV}
    link = set_link(None)
    set_link(link)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    set_link(link)
