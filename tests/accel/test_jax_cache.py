"""minidist's executable cache (minidist/accel/jax_cache.py): a program compiled in one process loads in
the next with the same bits, and anything that changes the program changes the key -- a stale
executable would be a silent wrong answer, so each test below is one way to get a wrong one."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from minidist.accel import compiled as seam  # noqa: E402
from minidist.accel import jax_cache, jax_compile, jax_ops  # noqa: E402
from minidist.accel.backend import get_backend  # noqa: E402

get_backend("jax")  # x64 on, as minidist runs JAX
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory of this test's own; returns the folder where executables go."""
    monkeypatch.setenv("MINIDIST_JAX_CACHE", str(tmp_path))
    return tmp_path / "exe"


def _files(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _fresh(fn, name="t", **kw):
    """A new Program for ``fn``, as a new process would make it: nothing compiled in memory."""
    ident = jax_cache.identity(fn)
    assert ident is not None
    return jax_cache.Program(name, fn, ("test", ident), **kw)


def _scaler(c):
    def scale(x):
        return x * c
    return scale


def test_a_changed_closure_value_is_a_different_program(cache):
    x = jax.device_put(np.arange(4.0))
    np.testing.assert_array_equal(_fresh(_scaler(2.0))(x), np.arange(4.0) * 2)
    before = dict(jax_cache.STATS)
    np.testing.assert_array_equal(_fresh(_scaler(3.0))(x), np.arange(4.0) * 3)  # not 2x, loaded
    assert jax_cache.STATS["loaded"] == before.get("loaded", 0)
    np.testing.assert_array_equal(_fresh(_scaler(2.0))(x), np.arange(4.0) * 2)
    assert jax_cache.STATS["loaded"] == before.get("loaded", 0) + 1  # the same closure: a hit
    assert len(_files(cache)) == 2


def test_a_changed_baked_in_argument_is_a_different_program(cache):
    """``seam.pure`` bakes plain arguments in (here ``k``): each value is its own program."""
    def times(x, k):
        return x * k

    x = jax.device_put(np.arange(3.0))
    got = [np.asarray(seam.pure(times)(x, k)) for k in (2.0, 5.0, 2.0)]  # a new `made` each
    np.testing.assert_array_equal(got[0], [0, 2, 4])
    np.testing.assert_array_equal(got[1], [0, 5, 10])
    np.testing.assert_array_equal(got[2], [0, 2, 4])
    assert len(_files(cache)) == 2


def _twice(x):
    return x + x


def test_a_changed_dtype_is_a_different_program(cache):
    """A loaded executable for float32 would reject float64 (counted as ``rejected``): the key must
    have told them apart before, so nothing is rejected and both are stored."""
    before = jax_cache.STATS["rejected"]
    for dtype in (np.float32, np.float64):
        y = _fresh(_twice)(jax.device_put(np.ones(3, dtype)))
        assert y.dtype == dtype
    assert jax_cache.STATS["rejected"] == before
    assert len(_files(cache)) == 2


def _add(a, b):
    return a + b


def test_weak_type_is_part_of_the_key(cache):
    """A weakly typed float64 scalar plus float32 is float32; a strongly typed one makes float64.
    A loaded executable takes either without complaint, so only the key keeps them apart."""
    f32 = jax.device_put(np.ones(2, np.float32))
    weak = jax.numpy.asarray(2.0, dtype=None) * 1  # a Python float's weak type survives `* 1`
    strong = jax.device_put(np.float64(2.0))
    assert weak.weak_type and not strong.weak_type
    assert _fresh(_add)(weak, f32).dtype == np.float32
    assert _fresh(_add)(strong, f32).dtype == np.float64


def _matmul(a, b):
    return a @ b


def test_jax_settings_are_part_of_the_key(cache):
    """The default matmul precision changes what XLA emits for ``a @ b`` (on a TPU, bf16 passes or
    not): a program compiled under one setting is not loaded under another."""
    a = jax.device_put(np.ones((4, 4), np.float32))
    before = jax_cache.STATS["loaded"]
    _fresh(_matmul)(a, a)
    with jax.default_matmul_precision("bfloat16"):  # (minidist's backend sets "highest")
        _fresh(_matmul)(a, a)
    assert jax_cache.STATS["loaded"] == before and len(_files(cache)) == 2
    with jax.default_matmul_precision("bfloat16"):
        _fresh(_matmul)(a, a)
    assert jax_cache.STATS["loaded"] == before + 1


def test_the_device_is_part_of_the_key(cache):
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("one JAX device (the tests force 8 CPU devices through XLA_FLAGS)")
    before = jax_cache.STATS["rejected"]
    for d in devices[:2]:
        y = _fresh(_twice)(jax.device_put(np.ones(3), d))
        assert y.sharding.device_set == {d}
    assert jax_cache.STATS["rejected"] == before
    assert len(_files(cache)) == 2


def _decay(x, y):
    return x * 0.5 + y


def test_donation_is_in_the_key_and_survives_a_load(cache):
    """An optimizer's state is donated (its buffer reused for the result): a loaded executable
    must donate too, and a program without donation is another program."""
    before = jax_cache.STATS["loaded"]
    for donate in ((), (0,), (0,)):
        x, y = jax.device_put(np.ones(4)), jax.device_put(np.ones(4))
        np.testing.assert_array_equal(_fresh(_decay, donate_argnums=donate)(x, y), np.full(4, 1.5))
        assert x.is_deleted() == bool(donate) and not y.is_deleted()
    assert jax_cache.STATS["loaded"] == before + 1  # the third: donating, from the file


def test_an_unnameable_closure_is_never_stored(cache):
    """A closure over an object whose repr does not say what it holds: compiled, never stored."""
    class Box:
        pass

    box = Box()
    box.k = 4.0

    def f(x):
        return x * box.k

    assert jax_cache.identity(f) is None
    prog = jax_cache.Program("t", f, None)
    np.testing.assert_array_equal(prog(jax.device_put(np.ones(2))), [4.0, 4.0])
    assert _files(cache) == []


def test_a_corrupted_file_is_recompiled_and_overwritten(cache):
    x = jax.device_put(np.arange(5.0))
    _fresh(_scaler(7.0))(x)
    [name] = _files(cache)
    path = cache / name
    seven, eight = np.float64(7.0).tobytes(), np.float64(8.0).tobytes()
    blob = path.read_bytes()
    assert seven in blob
    path.write_bytes(blob.replace(seven, eight))  # the baked-in 7.0 becomes 8.0: it would load and run
    before = dict(jax_cache.STATS)
    np.testing.assert_array_equal(_fresh(_scaler(7.0))(x), np.arange(5.0) * 7)
    assert jax_cache.STATS["corrupt"] == before.get("corrupt", 0) + 1
    assert jax_cache.STATS["compiled"] == before.get("compiled", 0) + 1
    for broken in (path.read_bytes()[:100], b""):  # truncated, empty: the same
        path.write_bytes(broken)
        np.testing.assert_array_equal(_fresh(_scaler(7.0))(x), np.arange(5.0) * 7)
    assert jax_cache.STATS["corrupt"] == before.get("corrupt", 0) + 3
    np.testing.assert_array_equal(_fresh(_scaler(7.0))(x), np.arange(5.0) * 7)  # rewritten: a hit
    assert jax_cache.STATS["loaded"] == before.get("loaded", 0) + 1


def _planted_entry(path, marker):
    """A cache file with a valid checksum whose pickle, once loaded, creates ``marker``: what someone
    who can write the folder could plant (issue 40)."""
    import hashlib
    import pickle

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    body = pickle.dumps({"key": "x", "exe": Boom()})
    path.write_bytes(jax_cache.FORMAT + hashlib.sha256(body).digest() + body)


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "another owner"])
def test_a_cache_folder_others_can_write_is_refused_and_nothing_runs(tmp_path, monkeypatch, capsys, how):
    """A cache entry is code the job runs; a folder another user can write (or owns) turns the cache
    off, with one warning naming the folder and why -- a planted entry there never loads."""
    folder = tmp_path / "shared"
    marker = tmp_path / "ran"
    x = jax.device_put(np.arange(3.0))
    monkeypatch.setenv("MINIDIST_JAX_CACHE", str(folder))
    _fresh(_scaler(4.0))(x)  # private still: the real entry is written
    [name] = _files(folder / "exe")
    _planted_entry(folder / "exe" / name, marker)  # ... and replaced with one that runs code
    if how == "another owner":
        os.chown(folder, 65534, 65534)
    else:
        os.chmod(folder, 0o777 if how == "world-writable" else 0o770)
    jax_cache_files = sys.modules["minidist.accel.jax_cache_files"]
    jax_cache_files._REFUSED.discard(str(folder))
    assert jax_cache.cache_root() is None and jax_cache.cache_dir() is None
    np.testing.assert_array_equal(_fresh(_scaler(4.0))(x), np.arange(3.0) * 4)
    assert not marker.exists()
    err = capsys.readouterr().err
    assert str(folder) in err and "the cache is off" in err and err.count("[minidist]") == 1
    assert ("owned by uid 65534" if how == "another owner" else "writable by other users") in err


def test_a_planted_entry_in_our_own_folder_would_run(cache):
    """Why the two tests around this one matter: the cache trusts its own private folder, so what is
    in it is unpickled -- the planted entry creates its marker (then fails its key check)."""
    x = jax.device_put(np.arange(3.0))
    _fresh(_scaler(6.0))(x)
    [name] = _files(cache)
    marker = cache.parent / "ran"
    _planted_entry(cache / name, marker)
    np.testing.assert_array_equal(_fresh(_scaler(6.0))(x), np.arange(3.0) * 6)
    assert marker.exists()


def test_an_entry_another_user_wrote_is_never_loaded(cache):
    """In a private folder, a file owned by someone else (planted before the folder was tightened)
    is treated as corrupt: compiled afresh, never unpickled."""
    x = jax.device_put(np.arange(3.0))
    _fresh(_scaler(5.0))(x)
    [name] = _files(cache)
    marker = cache.parent / "ran"
    _planted_entry(cache / name, marker)
    os.chown(cache / name, 65534, 65534)
    before = dict(jax_cache.STATS)
    np.testing.assert_array_equal(_fresh(_scaler(5.0))(x), np.arange(3.0) * 5)
    assert not marker.exists()
    assert jax_cache.STATS["corrupt"] == before.get("corrupt", 0) + 1


def test_an_executable_that_rejects_its_arguments_is_recompiled(cache, monkeypatch):
    """A file written under the wrong key (a float32 program where float64 belongs, as a key that
    forgot the dtype would do): the call rejects it, the program is compiled again and stored."""
    real_key = jax_cache.Program._key
    f64 = jax.device_put(np.ones(3))
    key64 = real_key(_fresh(_twice), (jax.tree_util.tree_flatten((f64,))[1],
                                      (jax_cache._leaf_sig(f64),), jax._src.config.trace_context()))
    monkeypatch.setattr(jax_cache.Program, "_key", lambda self, sig: key64)
    _fresh(_twice)(jax.device_put(np.ones(3, np.float32)))  # stored under float64's key
    monkeypatch.setattr(jax_cache.Program, "_key", real_key)
    before = jax_cache.STATS["rejected"]
    y = _fresh(_twice)(f64)
    assert y.dtype == np.float64 and jax_cache.STATS["rejected"] == before + 1
    assert _fresh(_twice)(f64).dtype == np.float64 and jax_cache.STATS["rejected"] == before + 1


def _new_process(monkeypatch):
    """Forget every op program this process made, as a new process starts (the cache stays)."""
    monkeypatch.setattr(jax_ops, "_FORWARD", {})
    monkeypatch.setattr(jax_ops, "_BACKWARD", {})


def test_an_ops_baked_number_is_in_its_key_and_its_trace_comes_back_from_the_file(cache, monkeypatch):
    """``x * c`` bakes ``c`` into Mul's forward and saves it for backward: a new process with
    another ``c`` must not load the old program, and one with the same ``c`` loads it (no trace)
    and still has what the trace learned -- the saved number -- for the gradient."""
    from minidist.autograd import ops
    from minidist.autograd.tensor import Tensor

    be = get_backend("jax")
    host = np.arange(1.0, 7.0).reshape(2, 3)
    for c in (2.0, 3.0, 2.0):
        _new_process(monkeypatch)
        loaded = jax_cache.STATS["loaded"]
        x = Tensor(be.from_host(host), requires_grad=True)
        y = ops.mul(x, c)
        assert y._node.ctx.saved[1] == c and isinstance(y._node.ctx.saved[1], float)
        y.sum().backward()
        np.testing.assert_array_equal(np.asarray(y.data), host * c)
        np.testing.assert_array_equal(np.asarray(x.grad), np.full((2, 3), c))
    assert jax_cache.STATS["loaded"] > loaded  # the last one: Mul and Sum, forward and backward


def test_evict_removes_the_least_recently_used_first(cache):
    """Four files of about one size S, 1 byte over the limit: down to 80% of it (3.2 S) means one
    goes -- the least recently used: not the oldest file, which was just loaded -- with a killed
    writer's temporary file from two hours ago."""
    x = jax.device_put(np.arange(3.0))
    _fresh(_scaler(1.5))(x)
    [first] = _files(cache)
    for c in (2.5, 3.5, 4.5):  # (not 1.0 or 2.0, which XLA simplifies into smaller programs)
        _fresh(_scaler(c))(x)
    others = [n for n in _files(cache) if n != first]
    for age, name in [(4, first), *enumerate(others)]:  # hours: the first 4, the others 0, 1, 2
        os.utime(cache / name, (os.path.getmtime(cache / name) - 3600 * age,) * 2)
    _fresh(_scaler(1.5))(x)  # a load: the first file is now the most recently used
    (cache / ".tmp-killed").write_bytes(b"half")
    os.utime(cache / ".tmp-killed", (os.path.getmtime(cache / ".tmp-killed") - 7200,) * 2)
    sizes = [(cache / n).stat().st_size for n in _files(cache) if n.endswith(".exe")]
    assert len(sizes) == 4 and max(sizes) < 1.05 * min(sizes)
    assert jax_cache.evict(limit_mb=(sum(sizes) - 1) / 1e6) == 2
    assert _files(cache) == sorted([first, others[0], others[1]])
    assert jax_cache.evict(limit_mb=1e6) == 0  # under the limit: nothing goes


_FACTOR = 2.0


def _by_factor(x):
    return x * _FACTOR


def _by_helper(x):
    return helper_module.times(x)


helper_module = None


def test_a_global_a_function_outside_minidist_reads_is_in_its_key(cache, monkeypatch, tmp_path):
    """A constant rebound at run time, and a helper edited in another file, make new keys: a new
    process compiles a new program instead of loading the old value's. (Checked by files and
    loads: in one process ``jax.jit`` reuses its trace of the same function object whatever the
    globals now hold -- JAX's own in-process rule.)"""
    import importlib

    x = jax.device_put(np.arange(3.0))
    module = sys.modules[_by_factor.__module__]
    np.testing.assert_array_equal(_fresh(_by_factor)(x), [0, 2, 4])
    monkeypatch.setattr(module, "_FACTOR", 5.0)
    src = tmp_path / "md_helper_for_cache_test.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    for k in (3, 4, 5):
        src.write_text(f"def times(x):\n    return x * {k}\n")
        mod = importlib.reload(importlib.import_module(src.stem))
        monkeypatch.setattr(module, "helper_module", mod)
        jax_cache._SOURCES.pop(mod.__file__, None)  # a new process reads the file again
        loaded = jax_cache.STATS["loaded"]
        _fresh(_by_helper)(x)
        assert jax_cache.STATS["loaded"] == loaded
    loaded = jax_cache.STATS["loaded"]
    _fresh(_by_factor)(x)
    assert jax_cache.STATS["loaded"] == loaded  # 5.0: not the file 2.0 wrote
    monkeypatch.setattr(module, "_FACTOR", 2.0)
    _fresh(_by_factor)(x)
    assert jax_cache.STATS["loaded"] == loaded + 1  # 2.0 again: that file
    assert len(_files(cache)) == 5


_TABLE = np.array([1.0, 2.0, 3.0])
_CFG = {"scale": 2.0}


def _by_table(x):
    return x * _TABLE


def _by_cfg(x):
    return x * _CFG["scale"]


def test_a_global_array_or_dict_is_never_baked_in_stale(cache, monkeypatch):
    """A program bakes in the globals it reads: an array's bytes have no faithful name, so such a
    function is never stored; a dict is named by its items, so a changed one is a new key. (Before,
    both were skipped from the key: a second process loaded W = 1 while W was 5.)"""
    assert jax_cache.identity(_by_table) is None
    before = jax_cache.identity(_by_cfg)
    monkeypatch.setitem(_CFG, "scale", 5.0)
    assert jax_cache.identity(_by_cfg) not in (None, before)


def test_identity_names_code_closures_and_defaults():
    def f(x, k=2):
        return x * k

    def g(x, k=3):
        return x * k

    def h(x, k=2):
        return x + k

    idents = [jax_cache.identity(fn) for fn in (f, g, h)]
    assert None not in idents and len(set(idents)) == 3
    assert jax_cache.identity(_scaler(1.0)) != jax_cache.identity(_scaler(1))  # 1.0 vs 1: repr differs
    assert jax_cache.identity(_scaler(object())) is None


# -- across processes ----------------------------------------------------------------------------
CHILD = r"""
import hashlib, json, sys
import numpy as np
from minidist.accel import jax_cache, jax_engine
from minidist.accel.backend import get_backend
from minidist.nn import GPT, GPTConfig
from minidist.nn.optim import AdamW

cfg = GPTConfig(vocab_size=13, block_size=4, n_layer=1, n_head=2, d_model=8, dtype="float32")
model = GPT(cfg, backend="jax")
opt = AdamW(model.parameters(), lr=1e-2)
rng = np.random.default_rng(0)
x, y = rng.integers(0, 13, (2, 4)), rng.integers(0, 13, (2, 4))
for _ in range(2):
    loss = model.loss(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
be = get_backend("jax")
h = hashlib.sha256(np.asarray(be.to_host(loss.data)).tobytes())
for k, p in model.named_parameters():
    h.update(be.to_host(p.data).tobytes())
print(json.dumps({"bits": h.hexdigest(), "stats": dict(jax_cache.STATS), "source": jax_cache.source_digest(),
                  "loaded": jax_engine.compilations("loaded")}))
"""


def _start(env):
    full = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    full.update(env, PYTHONPATH=ROOT, XLA_FLAGS="")
    return subprocess.Popen([sys.executable, "-c", CHILD], env=full, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_two_writers_at_once_then_a_reader_that_loads_everything_with_the_same_bits(tmp_path):
    """Two processes compile the same programs into one empty cache at the same moment (each file
    written whole, then renamed); a third compiles nothing, loads every program, and ends two
    AdamW steps of a GPT with bit-identical loss and parameters."""
    for attempt in range(3):  # (again, in a new folder, if minidist's source changed under the test)
        env = {"MINIDIST_JAX_CACHE": str(tmp_path / str(attempt))}
        writers = [_result(p) for p in [_start(env), _start(env)]]
        reader = _result(_start(env))
        if len({r["source"] for r in writers + [reader]}) == 1:
            break
    assert writers[0]["bits"] == writers[1]["bits"] == reader["bits"]
    files = _files(tmp_path / str(attempt) / "exe")
    assert files and not [f for f in files if not f.endswith(".exe")]  # no temporary file left
    stats = reader["stats"]
    assert stats.get("compiled", 0) == stats.get("unpersisted", 0) == 0, stats
    assert stats["loaded"] == reader["loaded"] == len(files), (stats, len(files))
    assert not stats.get("corrupt") and not stats.get("rejected"), stats


def test_cache_off_writes_nothing(tmp_path):
    """``MINIDIST_JAX_CACHE=0``: neither minidist's cache nor JAX's writes a file (HOME is empty)."""
    home = tmp_path / "home"
    home.mkdir()
    result = _result(_start({"MINIDIST_JAX_CACHE": "0", "HOME": str(home), "XDG_CACHE_HOME": str(home)}))
    assert not result["stats"].get("stored") and not result["stats"].get("loaded"), result["stats"]
    assert list(home.rglob("*")) == []


def test_stamp_unstamped_stamps_jax_entries_without_a_stamp_with_their_write_time(tmp_path):
    """JAX's ``<key>-cache`` files with no ``<key>-atime`` stamp get one: 8 bytes, little-endian
    nanoseconds, the entry's modification time. Stamped entries keep theirs; nothing is deleted;
    minidist's ``exe`` folder and other files are left alone; a missing folder is no error."""
    for name in ("old-cache", "new-cache", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "new-atime").write_bytes((12345).to_bytes(8, "little"))
    (tmp_path / "exe").mkdir()
    os.utime(tmp_path / "old-cache", ns=(5 * 10**18, 4 * 10**18))
    assert jax_cache.stamp_unstamped(str(tmp_path)) == 1
    assert _files(tmp_path) == [".lockfile", "exe", "new-atime", "new-cache", "notes.txt", "old-atime",
                                "old-cache"]  # (.lockfile: JAX's lock on the folder, held while stamping)
    assert int.from_bytes((tmp_path / "old-atime").read_bytes(), "little") == 4 * 10**18
    assert int.from_bytes((tmp_path / "new-atime").read_bytes(), "little") == 12345
    assert jax_cache.stamp_unstamped(str(tmp_path)) == 0
    assert jax_cache.stamp_unstamped(str(tmp_path / "missing")) == 0


def _jax_process(cache, prelude: str = ""):
    """A fresh process with its JAX cache in ``cache``: the JAX backend, then one eager JAX sum
    (JAX's own cache writes its program); prints the sum and JAX's cache cap."""
    code = (prelude + "import jax, jax.numpy as jnp\nfrom minidist.accel.backend import get_backend\n"
            "get_backend('jax')\n"
            "print(float((jnp.arange(5.0) * 3.0 + 1.0).sum()), jax.config.jax_compilation_cache_max_size)\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(MINIDIST_JAX_CACHE=str(cache), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_without_filelock_jax_keeps_an_uncapped_cache_that_works(tmp_path):
    """JAX locks a size-capped cache with filelock; without it, capping made every read and write of
    JAX's cache fail ("Please install the `filelock` package"), printed into the lesson. A fresh
    process that cannot import filelock keeps the cache uncapped, and it works."""
    out = _jax_process(tmp_path, "import sys\nsys.modules['filelock'] = None\n")
    assert out.stdout.split() == ["35.0", "-1"]  # the sum, and JAX's "no cap"
    assert "filelock" not in out.stderr and "Error" not in out.stderr, out.stderr
    assert any(n.endswith("-cache") for n in _files(tmp_path))  # it wrote its programs


def test_a_cache_from_before_the_cap_does_not_break_jax_writes(tmp_path):
    """A fresh process whose cache folder holds a JAX entry written before the size cap (no stamp):
    JAX writes its new entries without a warning. Before the fix every write failed with
    "Error writing persistent compilation cache entry ... -atime" printed into the lesson."""
    pytest.importorskip("filelock")  # (the jax extra installs it; without it JAX's cache is uncapped)
    (tmp_path / "jit_old-0123-cache").write_bytes(b"x" * 100)
    out = _jax_process(tmp_path)
    assert out.stdout.split()[0] == "35.0"
    assert "Error writing" not in out.stderr, out.stderr
    names = _files(tmp_path)
    written = [n for n in names if n.endswith("-cache")]
    assert "jit_old-0123-cache" in written and len(written) > 1  # kept, and new entries beside it
    assert all(n[:-len("-cache")] + "-atime" in names for n in written)


def test_a_jax_without_the_private_settings_compiles_stores_nothing_and_says_so(cache, monkeypatch):
    """If a JAX release drops the private settings the cache relies on, programs still compile (they
    used to fall back to eager dispatch without a word), nothing is stored, and one warning says why."""
    monkeypatch.setattr(jax_compile, "_PRIVATE_SETTINGS", ("a_setting_this_jax_lacks",
                                                          *jax_compile._PRIVATE_SETTINGS[1:]))
    monkeypatch.setattr(jax_compile, "_WARNED", set())
    x = jax.device_put(np.arange(3.0))
    before = dict(jax_cache.STATS)
    with pytest.warns(RuntimeWarning, match="stores no JAX executables") as seen:
        np.testing.assert_array_equal(_fresh(_scaler(6.5))(x), np.arange(3.0) * 6.5)
        np.testing.assert_array_equal(_fresh(_scaler(7.5))(x), np.arange(3.0) * 7.5)
    assert len([w for w in seen if "stores no" in str(w.message)]) == 1
    assert jax_cache.STATS["compiled"] - before.get("compiled", 0) == 2
    assert jax_cache.STATS["stored"] == before.get("stored", 0) and _files(cache) == []


def test_numpy_arguments_of_two_dtypes_are_two_programs(cache):
    """Host (NumPy) arguments are keyed by their dtype, not its kind: float32 and float64 are two
    programs, neither loaded for the other (nothing rejected), each result of its own dtype."""
    before = jax_cache.STATS["rejected"]
    for dtype in (np.float32, np.float64, np.float32):
        y = _fresh(_twice)(np.ones(3, dtype))
        assert y.dtype == dtype
    assert jax_cache.STATS["rejected"] == before
    assert len(_files(cache)) == 2


def test_value_ids_tell_types_and_containers_apart():
    v = jax_cache.value_id
    ids = [v(1), v(1.0), v(True), v((1, 2)), v([1, 2]), v((1.0, 2)), v({"a": 1}), v({"a": 1.0}),
           v(slice(0, 4)), v(slice(0, 4, 2)), v(np.float32), v(np.float64)]
    assert None not in ids and len(set(ids)) == len(ids)
    assert v((1, 2)) == v((1, 2)) and v(object()) is None and v([1, object()]) is None


def _static_mix(x, k):
    """A result that depends on every key-relevant trait of the baked-in ``k``: its type, container and
    values."""
    if isinstance(k, (tuple, list)):
        return x * len(k) + (k[0] if type(k) is tuple else -k[0])
    return x * k


_VARIANTS = [((3,), "float64", 2), ((3,), "float64", 2.0), ((3,), "int64", 2), ((3,), "int64", 2.0),
             ((3,), "int64", True), ((4,), "float64", 2), ((3,), "float32", 2), ((2, 3), "float64", 2),
             ((3,), "float64", (1, 2)), ((3,), "float64", [1, 2]), ((3,), "float64", (2, 2)),
             ((3,), "float64", 3)]


def test_calls_that_differ_in_anything_key_relevant_never_share_a_program(cache):
    """Every variant (shape, dtype, a baked-in value's value, type and container) through
    ``seam.pure`` twice, in a fresh wrapper each time (a new process's view: the persistent cache
    answers): every result equals eager NumPy in value and dtype, no loaded executable is rejected, and
    each variant stored a program of its own."""
    before = jax_cache.STATS["rejected"]
    for _ in range(2):
        for shape, dtype, k in _VARIANTS:
            x = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
            want = _static_mix(x, k)
            got = seam.pure(_static_mix)(jax.device_put(x), k)
            assert np.asarray(got).dtype == want.dtype, (shape, dtype, k)
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=str((shape, dtype, k)))
    assert jax_cache.STATS["rejected"] == before
    assert len(_files(cache)) == len(_VARIANTS)


def _by_factor_nested(x):
    def inner(y):
        return y * _FACTOR
    return inner(x)


def test_a_global_read_only_inside_a_nested_function_is_in_the_key(monkeypatch):
    """The inner function's globals are baked into the same program: rebinding ``_FACTOR`` must change
    the outer function's identity, as it does for a function that reads it directly."""
    module = sys.modules[_by_factor_nested.__module__]
    before, direct = jax_cache.identity(_by_factor_nested), jax_cache.identity(_by_factor)
    monkeypatch.setattr(module, "_FACTOR", 5.0)
    assert jax_cache.identity(_by_factor) != direct
    assert jax_cache.identity(_by_factor_nested) not in (None, before)
