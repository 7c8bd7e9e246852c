"""Each chapter's lesson at small settings: the one table the site's scripts share.

``docs/make_plots.py`` runs these commands with ``--plot`` to draw ``lessons/img/*.png``;
``docs/expected_output.py`` runs them to write each chapter's "Expected output" block, and
``tests/test_expected_output.py`` runs them again to check the block's shape. The settings are
small (threads transport, few ranks, tiny models) so that all of them together take about a minute:
the chapters' own commands show the full-size runs.
"""

from __future__ import annotations

# chapter file (lessons/NAME) -> its lesson's command (or commands) at small settings, on threads
SMALL = {
    "00-estimates.md": "python -m minidist.plan.estimates",
    "01-train.md": ("python -m minidist.lessons.train --steps 20 --batch 8 --block 32 "
                    "--d-model 32"),
    "02-allreduce.md": ("python -m minidist.lessons.allreduce --ranks 4 --elements 4096 --repeats 1 "
                        "--clock virtual --link ethernet"),
    "03-data-parallel.md": "python -m minidist.lessons.data_parallel --ranks 2 --steps 1 --seq 8 "
                           "--d-model 16 --layers 1 --overlap-d-model 64 --overlap-layers 2 --overlap-rows 4 "
                           "--overlap-bucket-kb 16 --clock virtual",
    "04-tensor-parallel.md": "python -m minidist.lessons.tensor_parallel --ranks 2 --steps 1 --seq 8 "
                             "--d-model 16 --layers 1 --overlap --clock virtual --device h100",
    "05-pipeline.md": "python -m minidist.lessons.pipeline --ranks 2 --dp 1 --steps 1 --width 16 --seq 8 "
                      "--layers 2 --microbatches 2 --batch 4",
    "06-checkpointing.md": "python -m minidist.lessons.checkpointing --ranks 2 --layers 2 --dim 16 --seq 8 "
                           "--batch 2 --repeats 1",
    "07-mixed-precision.md": ["python -m minidist.lessons.mixed_precision --ranks 2 --dim 16 --seq 8 "
                              "--layers 1",
                              "python -m minidist.lessons.numerics --ranks 2 --dim 16 --seq 8 --layers 1 "
                              "--steps 4"],
    "08-offload.md": "python -m minidist.lessons.offload --ranks 2 --dim 16 --seq 8 --steps 2",
    "09-inference.md": "python -m minidist.lessons.inference --ranks 2 --steps 10 --block 64 --d-model 16",
    "10-fault-tolerance.md": ["python -m minidist.launch -n 2 --threads -- python -m "
                              "minidist.lessons.fault_tolerance --steps 6",
                              "python -m minidist.lessons.live_recovery --ranks 4 --steps 8"],
    "11-planning.md": "python -m minidist.lessons.planning --ranks 8 --steps 3 --batch 8 --seq 8 --layers 2 "
                      "--width 16 --clock virtual --link nvlink --device h100",
    "12-compression.md": "python -m minidist.lessons.compression --ranks 2 --steps 8 --layers 1 --d-model 16 "
                         "--seq 8",
    "13-load-balancing.md": "python -m minidist.lessons.load_balancing --ranks 4 --batch 16 --pp-steps 4 "
                            "--pace 0.002",
    "14-long-context.md": "python -m minidist.lessons.long_context --ranks 2 --seq 16",
    "15-moe.md": "python -m minidist.lessons.moe --ranks 2 --tokens 64",
    "16-tpu.md": "python -m minidist.lessons.tpu --steps 2",
}


def module(command: str) -> str:
    """The lesson module a command runs: the last ``-m`` argument (after ``minidist.launch ... --``)."""
    words = command.split()
    return words[len(words) - 1 - words[::-1].index("-m") + 1]


def plot_name(chapter: str, index: int, command: str) -> str:
    """The picture of a chapter's ``index``-th command, relative to ``lessons/``: ``img/NN-name.png``
    for the first, ``img/NN-name-MODULE.png`` for the others."""
    stem = chapter.removesuffix(".md")
    return f"img/{stem}.png" if index == 0 else f"img/{stem}-{module(command).rsplit('.', 1)[-1]}.png"


# chapter -> lines whose number and order follow the measured times (regexes on the raw output):
# each only counts as there or not (docs/expected_output.py's shape_diff), not line for line
VOLATILE = {
    "09-inference.md": [r"^\s+(colocated|disaggregated) \(\d",  # wall-clock TPOT: in its band or not,
                        r"^\s+long prompts: disaggregated steady TPOT"],  # and which is lower
    "10-fault-tolerance.md": [r"^\s+\d+  \[[\d, ]+\]\s"],  # live recovery: the heal's step is timing
    "11-planning.md": [r"^\s*\d+ dp\d+ tp\d+ pp\d+"],  # candidate meshes, ranked by measured step time
    "13-load-balancing.md": [r"^\s*\d+\s+[\d.]+\s+[\d.]+\s+\[",  # a DP step: when shares move is timing
                             r"^shares moved after step"],
}
