"""Dependencies point one way: the import graph of minidist/ has no cycle but tensor <-> ops <-> fused.

The graph is read from the source with `ast`, never by importing: an edge A -> B means that
executing module A's top level (module body, class bodies, module-level if/try; not function
bodies, not `if TYPE_CHECKING:`) imports B. `from minidist.pkg import name` points at the
submodule `minidist.pkg.name` when that file exists, else at the package (its __init__, whose own
re-exports are the package's edges). Importing `minidist.a.b` also runs `minidist/a/__init__.py`,
so that is an edge too, unless the importer lives inside `minidist.a` (Python initialises a
package before its submodules, so that one is never a cycle).

Function-local imports of minidist modules are allowed only with a comment, on the same line or
the line above, naming the cycle they break ("cycle: ...") or the optional heavy dependency they
defer ("defers mpi4py", ...). Two named rules are checked by name: checkpointing knows nothing of
the TP GPT, and the pipeline does not reach into checkpointing internals.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "minidist"
# none: ops attach Tensor's operators to it, and fused registers its fast forms in ops.FAST
ALLOWED_CYCLES = []
REASON = re.compile(r"\bcycle\b|\bdefers?\b", re.IGNORECASE)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Map every module under `root` to its file: minidist/comm/__init__.py -> minidist.comm."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_imports(node: ast.AST, local: bool):
    """Yield (import node, is_function_local) for every import under `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, local
        elif isinstance(child, ast.If) and _is_type_checking(child):
            continue  # never executed at run time
        else:
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _walk_imports(child, inner)


@functools.cache
def _imports_of(path: Path, text: str) -> tuple:
    """``_walk_imports`` of one file's text, parsed once per text: four tests walk the whole package."""
    return tuple(_walk_imports(ast.parse(text, str(path)), local=False))


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def targets(node: ast.AST, module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """The minidist modules one import statement loads (submodule when the name is one)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from .x import y
            pkg = _package_of(module, path).split(".")
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        names = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            names.append(sub if sub in modules else base)
    return [n for n in names if n == "minidist" or n.startswith("minidist.")]


def _with_parents(target: str, module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """`target` plus the packages whose __init__ importing it runs, minus the importer's own."""
    own = _package_of(module, path).split(".")
    own_ancestors = {".".join(own[:i]) for i in range(1, len(own) + 1)}
    parts = target.split(".")
    found = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in found if m in modules and m not in own_ancestors and m != module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> set of minidist modules its top level imports (see the module docstring)."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node, local in _imports_of(path, path.read_text()):
            if local:
                continue
            for t in targets(node, module, path, modules):
                graph[module] |= _with_parents(t, module, path, modules)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def local_imports(root: Path = ROOT):
    """Yield (file, line, source line, comment found, importing module, modules it would load) for
    each function-local minidist import."""
    modules = module_files(root)
    for module, path in modules.items():
        text = path.read_text()
        lines = text.splitlines()
        for node, local in _imports_of(path, text):
            if not local or not targets(node, module, path, modules):
                continue
            same = lines[node.lineno - 1]
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            comment = same.partition("#")[2] if "#" in same else ""
            if above.startswith("#"):
                comment += " " + above
            deps = set().union(*(_with_parents(t, module, path, modules)
                                 for t in targets(node, module, path, modules)))
            yield path.relative_to(root.parent), node.lineno, same.strip(), comment, module, deps


def test_the_only_import_cycles_are_the_autograd_cores():
    found = [c for c in cycles(import_graph()) if set(c) not in ALLOWED_CYCLES]
    assert not found, f"import cycles in minidist/ (modules in each): {found}"


def unexplained(root: Path = ROOT) -> list[str]:
    """Function-local minidist imports whose comment names neither a cycle nor a deferred dependency."""
    return [f"{f}:{n}: {src}" for f, n, src, comment, _, _ in local_imports(root)
            if not REASON.search(comment)]


def stale_cycles(root: Path = ROOT) -> list[str]:
    """Function-local imports whose '# cycle' comment is false: nothing they load imports them back."""
    graph = import_graph(root)
    return [f"{f}:{n}: {src}" for f, n, src, comment, module, deps in local_imports(root)
            if re.search(r"\bcycle\b", comment, re.IGNORECASE)
            and not any(module in _reachable(graph, d) for d in deps)]


def test_function_local_minidist_imports_say_which_cycle_they_break():
    bad = unexplained()
    assert not bad, (
        "function-local minidist imports need a comment on the same line or the line above naming "
        "the cycle they break ('# cycle: a -> b -> a') or the heavy dependency they defer "
        "('# defers mpi4py'); hoist them to the top if neither:\n" + "\n".join(bad)
    )


def test_each_cycle_a_local_import_names_is_real():
    """A '# cycle' comment that no longer holds leaves an import local for nothing."""
    stale = stale_cycles()
    assert not stale, "these local imports break no cycle; hoist them to the top:\n" + "\n".join(stale)


def _all_imports(path: Path) -> list[str]:
    """Every module a file imports, at any depth (function-local too), and `module.name` of each name."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


CHECKPOINTING = ["minidist.parallel.memory.recompute", "minidist.resilience.checkpoint",
                 "minidist.resilience.checkpoint.files", "minidist.resilience.checkpoint.layout",
                 "minidist.resilience.checkpoint.state", "minidist.resilience.checkpoint.tiers"]


def test_checkpointing_knows_nothing_of_the_tp_gpt():
    """Activation checkpointing recognises a block by its shape, and the checkpoint files by the
    layers' declared sharding: neither imports the TP GPT, directly or through what it imports.
    (resilience/trainer.py is handed its job: it imports none.)"""
    modules, graph = module_files(), import_graph()
    direct = {m: [n for n in _all_imports(modules[m]) if "tp_gpt" in n]
              for m in CHECKPOINTING + ["minidist.resilience.trainer"]}
    through = {m: sorted(x for x in _reachable(graph, m) if x == "minidist.parallel.tensor.gpt")
               for m in CHECKPOINTING}
    bad = {m: v for m, v in list(direct.items()) + list(through.items()) if v}
    assert not bad, f"checkpointing must not depend on the TP GPT: {bad}"


def test_the_pipeline_uses_no_checkpointing_internals():
    """The pipeline calls activation checkpointing's public functions only: no `_private` names
    imported from parallel.recompute or checkpoint/, none reached as `recompute._x`."""
    path = ROOT / "parallel" / "pipeline" / "runtime.py"
    names = _all_imports(path)
    private = r"minidist\.(parallel\.memory\.recompute|resilience\.checkpoint)\b.*\._"
    bad = [n for n in names if re.match(private, n)]
    bad += re.findall(r"\brecompute\._\w+", path.read_text())
    assert not bad, f"parallel/pipeline/runtime.py reaches into checkpointing privates: {bad}"


def test_the_checker_sees_planted_cycles_and_comments(tmp_path):
    """The checker itself can fail: a three-module cycle (one edge through a submodule named in
    `from pkg import name`, one through `import pkg.sub.mod`) is found; local imports without a
    reason, and one whose '# cycle:' is not a cycle, are flagged; a real one passes."""
    pkg = tmp_path / "minidist"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from minidist import b\n")
    (pkg / "b.py").write_text("import minidist.sub.c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def f():\n    from minidist import a  # cycle: a -> b -> c\n"
                                     "from minidist.a import x\n")
    (pkg / "d.py").write_text("def g():\n    import minidist.a\n")
    (pkg / "e.py").write_text("def h():\n    # cycle: b imports e (no)\n    from minidist import b\n")
    assert cycles(import_graph(pkg)) == [["minidist.a", "minidist.b", "minidist.sub.c"]]
    assert unexplained(pkg) == ["minidist/d.py:2: import minidist.a"]
    assert stale_cycles(pkg) == ["minidist/e.py:3: from minidist import b"]
