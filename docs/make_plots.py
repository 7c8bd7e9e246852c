"""Draw each lesson's ``--plot`` picture at small settings into ``lessons/img/``, for the chapters.

    python docs/make_plots.py                 # every chapter whose lesson takes --plot
    python docs/make_plots.py 02-allreduce.md

Runs the commands of ``docs/lessons.py`` (``SMALL``) with ``--plot lessons/img/NN-NAME.png`` added,
each as ``docs/expected_output.py`` runs it (fresh process, threads transport); a lesson whose
``--help`` has no ``--plot`` is skipped with a line that says so. The chapters' "Expected output"
blocks show the picture once it exists (``python docs/expected_output.py --write``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from expected_output import ROOT, commands, run  # noqa: E402

from lessons import SMALL, module, plot_name  # noqa: E402


def takes_plot(command: str) -> bool:
    """Whether the lesson that ``command`` runs has a ``--plot`` flag (its ``--help`` says so)."""
    return "--plot" in run(f"python -m {module(command)} --help")


def main(argv: list[str]) -> int:
    unknown = [c for c in argv if c not in SMALL]
    if unknown:
        print(f"unknown chapter {unknown[0]!r}: choose from {', '.join(SMALL)}", file=sys.stderr)
        return 2
    (ROOT / "lessons" / "img").mkdir(exist_ok=True)
    failed = 0
    for chapter in argv or list(SMALL):
        for i, command in enumerate(commands(chapter)):
            if not takes_plot(command):
                print(f"lessons/{chapter}: {module(command)} has no --plot; skipped")
                continue
            out = ROOT / "lessons" / plot_name(chapter, i, command)
            try:
                run(f"{command} --plot {out}")
            except RuntimeError as e:  # one lesson's broken plot must not stop the others
                print(f"lessons/{chapter}: FAILED {e}", file=sys.stderr)
                failed += 1
                continue
            print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size // 1024} KiB)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
