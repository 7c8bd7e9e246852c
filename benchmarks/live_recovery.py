"""Live recovery against checkpoint/restart, for one failure at step k of n with checkpoints every c.

    python benchmarks/live_recovery.py [--groups 4] [--steps 30] [--kill 17] [--every 10] [--strict]

The same job both ways (``minidist.lessons.live_recovery_job``: G replica groups, one thread each,
AdamW), with a disk checkpoint every c steps:

* **checkpoint/restart** -- at step k every group dies (as an MPI job does when one rank is killed);
  the job starts again (a new process per rank: the start of one, measured here, is added), restores
  the newest checkpoint and redoes the steps since;
* **live recovery** -- group 1 dies at step k; the others finish the step without it, its replacement
  heals from a live peer and rejoins.

Printed: the steps of work redone, the samples not trained (a group absent for a step is 1/G of a
step), the wall time from the kill to the next finished step, the bytes a heal moves against the
checkpoint's size (a restart reads one per group), and the expected loss of each approach at a
failure rate: per unit time, C/(c·t) for saving plus λ times the cost of one failure -- R + (c/2)·t
for a restart (Young/Daly), δ + (A/G)·t for live recovery (δ: the survivors' extra time on the failed
step, A: the steps the group is absent). MET / MISSED per target; ``--strict`` exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from bench_env import Targets, clock_flags, print_machine, use_clock  # noqa: E402

from minidist.lessons.live_recovery_job import LiveGPTJob, live_config  # noqa: E402
from minidist.resilience.attempts import newest_good_checkpoint  # noqa: E402
from minidist.resilience.checkpoint.tiers import Checkpointer, Tier  # noqa: E402
from minidist.resilience.live import run_threads  # noqa: E402

HOURS = (1, 5, 24)  # job MTBFs the expected loss is printed for (10,000 chips at 50,000 h each: 5 h)


def job(args, folder, faults, resume=False):
    cfg = live_config(dropout=0.0, n_layer=args.layers).replace(d_model=args.d_model)
    tiers = [Tier("disk", folder, every=args.every, keep=2)]
    t0 = time.monotonic()
    r = run_threads(lambda g, pos: LiveGPTJob(cfg, g, pos, args.groups, args.rows), args.groups, 1,
                    args.steps, faults=faults, rows=args.rows, say=lambda s: None, resume=resume,
                    hang_timeout=30,
                    checkpointer=lambda comm: Checkpointer(comm, tiers, asynchronous=False),
                    newest_checkpoint=lambda: newest_good_checkpoint(folder)[0])
    return r, t0


def process_start() -> float:
    """Seconds a fresh interpreter takes to import what a rank of this job imports (a restart's
    processes start in parallel: one start is the cost)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import minidist.lessons.live_recovery_job"], check=True,
                   env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    return time.perf_counter() - t0


def checkpoint_bytes(folder: str, step: int) -> int:
    d = os.path.join(folder, f"step-{step:08d}")
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill", type=int, default=17, help="the step the failure happens in (k)")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every c steps")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--strict", action="store_true")
    clock_flags(ap)
    args = ap.parse_args()
    use_clock(args, wall_only="it times process starts, disk checkpoints and a failure's detection, "
                              "which no rank's clock prices")
    if not (0 < args.kill < args.steps - 2 and args.every >= 1 and args.groups >= 2):
        ap.error("need 0 < --kill < --steps - 2, --every >= 1, --groups >= 2")
    print_machine()
    k, c, G = args.kill, args.every, args.groups
    tmp = tempfile.mkdtemp(prefix="minidist-bench-live-")
    try:
        # -- live recovery ----------------------------------------------------------------------
        live, _ = job(args, os.path.join(tmp, "live"), f"kill:group=1,step={k}")
        steps = {r.step: r for r in live.history}
        normal = [r.t1 - r.t0 for r in live.history if r.attempts == 1 and not r.healing and r.step > 0]
        t_step = float(np.median(normal))
        lost_at = next(t for t, kind, g, _ in live.events if kind == "lost")
        live_next = steps[k].t1 - lost_at
        absent = [r.step for r in live.history if 1 not in r.participants]
        not_trained = sum(G - len(r.participants) for r in live.history) / G
        heal_bytes = sum(h[5] for h in live.heals)
        # -- checkpoint/restart: the whole job dies at step k, a restart resumes from the checkpoint --
        folder = os.path.join(tmp, "restart")
        dead, _ = job(args, folder, ";".join(f"kill:group={g},step={k}" for g in range(G)))
        assert dead.error is not None, "the job was meant to die"
        died = max(t for t, kind, _, _ in dead.events if kind == "lost")
        ckpt = newest_good_checkpoint(folder)[0]
        size = checkpoint_bytes(folder, ckpt)
        again, started = job(args, folder, "", resume=True)
        launch = process_start()
        redo = {r.step: r for r in again.history}
        restart_next = (started - died) + launch + (redo[k].t1 - started)
        restore = redo[ckpt].t0 - started   # building the job and restoring, before its first step
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\njob: {G} replica groups x {args.rows} rows, GPT d_model {args.d_model}, {args.layers} layers, "
          f"AdamW, float64; {args.steps} steps, failure in step k = {k}, checkpoint every c = {c}")
    print(f"a step: {t_step * 1e3:.1f} ms (median of the steps without a failure or a heal)\n")
    print(f"{'':34}{'checkpoint/restart':>20}{'live recovery':>16}")
    print(f"{'steps of work redone':34}{k - ckpt:>20}{0:>16}")
    print(f"{'samples not trained (steps of G)':34}{k - ckpt:>20}{not_trained:>16.2f}")
    print(f"{'kill -> next finished step (s)':34}{restart_next:>20.3f}{live_next:>16.3f}")
    print(f"{'  of it: starting processes (s)':34}{launch:>20.3f}{0:>16}")
    print(f"{'state moved (bytes)':34}{G * size:>20,}{heal_bytes:>16,}")
    print(f"  restart: each of the {G} groups reads the checkpoint of step {ckpt} ({size:,} bytes: "
          f"parameters, AdamW m, v, small state); live: one heal from a peer's memory, {heal_bytes:,} bytes")
    print(f"  live: group 1 absent in steps {absent} (it healed during the last of them)")
    # -- the formula: expected fraction of the time lost at failure rate 1/MTBF --------------------
    R = (started - died) + launch + restore           # restart: detect, start, restore
    delta = max(live_next - t_step, 0.0)              # live: the survivors' extra time on the failed step
    A = len(absent)
    save = float(np.median([r.t0 - p.t1 for p, r in zip(again.history, again.history[1:])
                            if r.step % c == 0])) if args.steps - ckpt > c else 0.0
    print(f"\nexpected loss at failure rate lambda = 1/MTBF, as a fraction of the time: C/(c t) for saving "
          f"({save * 1e3:.1f} ms a save every {c} steps of {t_step * 1e3:.1f} ms: {save / (c * t_step):.2%}, "
          f"the same for both here -- live recovery needs checkpoints only for the whole job's failure, so "
          f"it can save far less often) plus lambda x the cost of one failure:")
    print(f"  restart: R + (c/2) t = {R:.3f} + {c / 2 * t_step:.3f} s   (R: detect, start, restore)")
    print(f"  live:    delta + (A/G) t = {delta:.3f} + {A / G * t_step:.3f} s   (delta: the failed step's "
          f"extra time, A = {A} steps absent)")
    print(f"  {'job MTBF':>10}{'restart':>14}{'live':>14}")
    for h in HOURS:
        lam = 1 / (h * 3600)
        print(f"  {h:>8} h{lam * (R + c / 2 * t_step):>14.5%}{lam * (delta + A / G * t_step):>14.5%}")
    targets = Targets()
    targets.check("steps redone by live recovery", 0, "<=", 0)
    targets.check("restart kill->step measured / formula R + (k - ckpt + 1) t", restart_next /
                  (R + (k - ckpt + 1) * t_step), "<=", 1.3)
    targets.check("live kill->step / restart kill->step", live_next / restart_next, "<=", 0.5)
    targets.check("live kill->step / (2 t): the survivors redo only the reduction", live_next / (2 * t_step),
                  "<=", 1.0)
    targets.check("bytes a heal moves / one checkpoint", heal_bytes / size, "<=", 1.0)
    return targets.exit_code(args.strict)


if __name__ == "__main__":
    sys.exit(main())
