"""resilience/ saves and restores the state it is handed: it imports no technique, directly or through
what it imports (issue 39)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TECHNIQUES = ("minidist.parallel", "minidist.infer", "minidist.plan", "minidist.lessons", "minidist.grading")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_resilience_imports_no_technique():
    files = {_module(p): p for p in (ROOT / "minidist").rglob("*.py")}
    todo = [m for m in files if m.startswith("minidist.resilience") and m != "minidist.resilience.stragglers"]
    seen, bad = set(todo), []
    while todo:
        m = todo.pop()
        for name in _imports(files[m]):
            if name.startswith(TECHNIQUES):
                bad.append(f"{m} imports {name}")
            elif name in files and name not in seen and not name.startswith("minidist.comm.transports"):
                seen.add(name)
                todo.append(name)
    assert not bad, bad
