"""Every pipeline schedule by name: what `--schedule` and `train_3d(schedule=...)` accept.

One table (`SCHEDULES`) maps a name to the function building its instruction lists; each returns a
`Schedule` carrying its placement, so a caller cuts the model into `schedule.placement.num_virtual`
pieces and hands the placement to `PipelineStage`.
"""

from __future__ import annotations

from minidist.parallel.pipeline.dualpipe import dualpipe, dualpipe_v
from minidist.parallel.pipeline.schedule import ScheduleError, gpipe, interleaved_1f1b, one_f_one_b
from minidist.parallel.pipeline.zb_h2 import zb_h2
from minidist.parallel.pipeline.zb_v import zb_v
from minidist.parallel.pipeline.zero_bubble import zb_h1

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2, "zb-v": zb_v,
             "dualpipe-v": dualpipe_v, "dualpipe": dualpipe}
V_SCHEDULES = ("zb-v", "dualpipe-v")  # two chunks per rank in a V: the model is cut in 2p pieces


def schedule_chunks(name: str, chunks: int = 1) -> int:
    """Pieces of the model per rank schedule `name` runs: `chunks` for interleaved, 2 for a V, else 1
    (DualPipe holds two, but the same p pieces twice: the model is cut in p)."""
    return 2 if name.replace("_", "-") in V_SCHEDULES else chunks if name == "interleaved" else 1


def make_schedule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1) -> list[list]:
    """The instruction lists (a `Schedule`, with its `placement`) of schedule `name`: one of
    "gpipe", "1f1b", "interleaved" (`chunks` per stage), "zb-h1", "zb-h2", "zb-v", "dualpipe-v",
    "dualpipe" (two model copies, p even)."""
    if name == "interleaved":
        return interleaved_1f1b(num_stages, num_microbatches, chunks)
    build = SCHEDULES.get(name.replace("_", "-"))
    if build is None:
        names = ", ".join(repr(n) for n in ["interleaved", *SCHEDULES])
        raise ScheduleError(f"unknown schedule {name!r}: use one of {names}")
    return build(num_stages, num_microbatches)
