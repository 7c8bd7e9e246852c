"""The notebooks of lessons 1-3 (``notebooks/*.ipynb``) run top to bottom on the threads transport.

Each notebook asserts its own result against a formula or a serial twin (the loss falls below the
uniform guess ln 256; every rank's all-reduce holds 1 + 2 + 3 + 4 and the ring sent 2(p-1)/p·N
bytes; DDP equals one process to 1e-9), so executing it checks the lesson as a reader would see it.
Needs nbclient and ipykernel (``pip install -e ".[docs]"``); skipped with that reason without them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

nbformat = pytest.importorskip("nbformat", reason='needs nbformat: pip install -e ".[docs]"')
nbclient = pytest.importorskip("nbclient", reason='needs nbclient: pip install -e ".[docs]"')
pytest.importorskip("ipykernel", reason='needs ipykernel: pip install -e ".[docs]"')


def execute(path: Path, timeout: int = 120):
    """Run every cell of the notebook at ``path`` in a fresh python3 kernel, from the repository root."""
    nb = nbformat.read(path, as_version=4)
    saved = dict(os.environ)
    os.environ.pop("MINIDIST_TRANSPORT", None)  # threads, whatever the test run was started with
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    try:  # the kernel is a child process: it inherits this environment
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return nb


def test_the_first_three_lessons_have_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01-train.ipynb", "02-allreduce.ipynb", "03-data-parallel.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_its_checks_pass(path):
    nb = execute(path)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any(o.get("output_type") == "stream" for o in outputs), "the notebook printed nothing"


def test_a_failing_cell_fails_the_run(tmp_path):
    """The runner is not toothless: a notebook whose check is wrong raises CellExecutionError."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from minidist.comm import run\n"
                                          "assert run(lambda comm: comm.rank, ranks=2) == [0, 2]")]
    path = tmp_path / "bad.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="AssertionError"):
        execute(path)
