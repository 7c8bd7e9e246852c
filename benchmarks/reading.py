"""What a student must read to follow each chapter: the lines of the minidist files the chapter cites.

    python benchmarks/reading.py                 # this checkout
    python benchmarks/reading.py --before REV    # side by side with an earlier commit (git must know REV)

Per chapter (lessons/NN-*.md): the number of distinct ``minidist/**/*.py`` files it cites, their lines
added up, and its longest cited file. A file over ``--limit`` lines (300: DESIGN.md's "under ~300
lines") is listed. The target is a clear drop from before to after and no cited file over the limit;
MET/MISSED is printed for the limit.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITE = re.compile(r"(?<![\w/])minidist/[\w/]+\.py\b")


def _show(rev: str | None, path: str) -> str | None:
    if rev is None:
        p = ROOT / path
        return p.read_text() if p.is_file() else None
    res = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return res.stdout if res.returncode == 0 else None


def _chapters(rev: str | None) -> list[str]:
    if rev is None:
        return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "lessons").glob("[0-9][0-9]-*.md"))
    out = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:lessons"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return sorted(f"lessons/{n}" for n in out if re.match(r"\d\d-.*\.md$", n))


def reading(rev: str | None) -> dict:
    """chapter number -> (files cited, lines, (longest file, its lines))."""
    out = {}
    for ch in _chapters(rev):
        text = _show(rev, ch) or ""
        files = {}
        for path in sorted(set(CITE.findall(text))):
            src = _show(rev, path)
            if src is not None:
                files[path] = src.count("\n")
        longest = max(files.items(), key=lambda kv: kv[1], default=("-", 0))
        out[Path(ch).name[:2]] = (Path(ch).stem, len(files), sum(files.values()), longest)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="an earlier commit to compare with")
    ap.add_argument("--limit", type=int, default=300, help="lines a cited file should stay under")
    args = ap.parse_args()
    after = reading(None)
    before = reading(args.before) if args.before else {}
    print(f"{'chapter':<22} {'files':>5} {'lines':>6}" + (f" {'before':>7} {'ratio':>6}" if before else "")
          + "  longest cited file")
    over = []
    for num, (name, n, lines, (path, longest)) in after.items():
        row = f"{name:<22} {n:>5} {lines:>6}"
        if before:
            b = before.get(num, (None, 0, 0, None))[2]
            row += f" {b:>7} {lines / b if b else float('nan'):>6.2f}"
        print(f"{row}  {path} ({longest})")
        over += [(path, longest)] if longest > args.limit else []
    total_after = sum(v[2] for v in after.values())
    if before:
        total_before = sum(v[2] for v in before.values())
        print(f"{'all chapters':<22} {'':>5} {total_after:>6} {total_before:>7} "
              f"{total_after / total_before:>6.2f}")
    for path, n in sorted(set(over)):
        print(f"over {args.limit} lines: {path} ({n})")
    print(f"cited files under {args.limit} lines: {'MET' if not over else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
