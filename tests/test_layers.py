"""Imports follow the layers (DESIGN.md, issue 39): every import of a minidist module -- at the top or
inside a function -- points down the layers, and a technique imports only what it builds on.

    lessons/ grading/ grade.py     the course: may import anything; nothing below imports them
    plan/ resilience/              resilience imports no technique (it saves what it is handed)
    parallel/parallelize ...       the composition layer: the one place techniques meet
    parallel/<technique>/ infer/   each imports comm, nn, autograd, accel, trace and what it builds on
    nn/  comm/  autograd/  accel/  trace/
"""

from __future__ import annotations

import ast

import pytest

from tests.test_imports import ROOT, _imports_of, module_files, targets

BASE = {"comm", "nn", "autograd", "accel", "trace"}
COMPOSITION = {"parallelize", "options", "parallelized", "parallelize_parts", "three_d"}
#: what each part may import besides itself (techniques also BASE); ``parallel.X`` is a technique folder
ALLOWED = {
    "trace": set(),
    "accel": set(),
    "autograd": {"accel", "trace"},
    "comm": {"autograd", "accel", "trace"},
    "nn": {"autograd", "accel", "trace"},
    "parallel.data": BASE,
    "parallel.tensor": BASE,
    "parallel.pipeline": BASE,
    "parallel.context": BASE,
    "parallel.experts": BASE,
    "parallel.memory": BASE,
    "parallel.spmd": BASE,
    "parallel.balance": BASE | {"parallel.data", "parallel.pipeline"},  # chapter 13 builds on 3 and 5
    "infer": BASE | {"parallel.tensor"},                                 # chapter 9 builds on 4
    "resilience": BASE,
}
#: a single module that builds on another technique, and why
BUILDS_ON = {"minidist.parallel.data.compress.fp8": {"parallel.memory"}}  # FP8 gradients: chapter 7's formats
COURSE = {"lessons", "grading", "grade"}


def part(module: str) -> str:
    bits = module.split(".")
    if len(bits) < 2:
        return "root"
    if bits[1] == "parallel" and len(bits) > 2:
        return "composition" if bits[2] in COMPOSITION else f"parallel.{bits[2]}"
    return bits[1]


def edges(root=ROOT):
    """(importer, imported) for every minidist import, top-level and function-local alike."""
    mods = module_files(root)
    for module, path in mods.items():
        for node, _local in _imports_of(path, path.read_text()):
            for t in targets(node, module, path, mods):
                if t != "minidist" and t != module:
                    yield module, t


def against_layers(root=ROOT) -> list[str]:
    bad = []
    for importer, imported in edges(root):
        a, b = part(importer), part(imported)
        if a == b or a not in ALLOWED or b in BUILDS_ON.get(importer, ()):
            continue
        if b not in ALLOWED[a] and not (a.startswith("parallel.") and b in BASE):
            bad.append(f"{importer} -> {imported} ({a} may import {sorted(ALLOWED[a]) or 'nothing'})")
    return sorted(bad)


def test_every_import_points_down_the_layers():
    bad = against_layers()
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_techniques_never_import_the_composition_layer():
    bad = [f"{i} -> {t}" for i, t in edges() if part(i).startswith(("parallel.", "infer"))
           and part(t) == "composition"]
    assert not bad, "techniques must not import parallelize and its parts:\n" + "\n".join(bad)


def test_library_code_imports_no_course_code():
    """Lessons and graders sit on top: nothing of the library imports them (only they and grade.py)."""
    bad = [f"{i} -> {t}" for i, t in edges() if part(t) in COURSE and part(i) not in COURSE]
    assert not bad, "\n".join(bad)


def test_no_importlib_or_dunder_import_tricks():
    """Modules are imported by name; only the grader loader in grade.py loads a student's file."""
    bad = []
    for module, path in module_files().items():
        if module == "minidist.grade":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else
                    node.func.attr if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    else None)
            if name in ("__import__", "import_module", "spec_from_file_location"):
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):  # importlib.resources (package data) is fine
                names = [f"{getattr(node, 'module', None) or ''}.{a.name}".strip(".") for a in node.names]
                if any(n.startswith("importlib") and "resources" not in n for n in names):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {names}")
    assert not bad, "\n".join(bad)


def test_at_most_four_modules_at_the_package_root():
    roots = {p.name for p in ROOT.glob("*.py")}
    assert roots <= {"__init__.py", "launch.py", "grade.py", "calibrate.py"}, sorted(roots)


ROOMS = ("autograd", "nn", "comm", "parallel", "infer")


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_room_a_reader_can_find(path):
    """Module docstrings say what and why in at most 20 lines; files of autograd/, nn/, comm/,
    parallel/ and infer/ have at most 300 lines."""
    text = path.read_text()
    doc = ast.get_docstring(ast.parse(text), clean=False) or ""
    lines = len(doc.splitlines())
    assert lines <= 20, f"{lines}-line module docstring: move the rest to the chapter"
    if path.relative_to(ROOT).parts[0] in ROOMS:
        assert text.count("\n") <= 300, f"{text.count(chr(10))} lines: split it by idea"


def test_the_layer_rules_catch_a_planted_import(tmp_path):
    """The checker is not toothless: in a copy of the tree, comm importing a technique (inside a
    function) and DDP importing tensor parallelism are both caught, and nothing else."""
    import shutil

    tree = tmp_path / "minidist"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    (tree / "comm" / "planted.py").write_text("def f():\n    from minidist.parallel.data import ddp\n")
    with open(tree / "parallel" / "data" / "ddp.py", "a") as f:
        f.write("\nfrom minidist.parallel.tensor import layers  # noqa\n")
    new = sorted(set(against_layers(tree)) - set(against_layers()))
    assert [b.split(" (")[0] for b in new] == [
        "minidist.comm.planted -> minidist.parallel.data.ddp",
        "minidist.parallel.data.ddp -> minidist.parallel.tensor.layers"]
