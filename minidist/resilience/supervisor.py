"""``python -m minidist.launch``: start a job, watch it, restart it from its last good checkpoint.

    python -m minidist.launch -n 4 --max-restarts 3 [--min-ranks 2] [--threads] [--ckpt DIR] [--job ID] \\
        [--fault "kill:rank=1,step=5"] -- python -m minidist.lessons.fault_tolerance --ckpt DIR

The job runs under ``mpirun -n N`` (``--threads``: one process given ``--ranks N``). The supervisor
watches its exit status and a heartbeat per rank (``heartbeat.py``): a rank silent for longer than
``--heartbeat-timeout`` seconds is hung, and the job is killed. On a failure it says what failed and
when, finds the newest intact checkpoint under ``--ckpt`` (``attempts.py``: where the job resumes)
and starts the job again with ``MINIDIST_RESTART`` one higher; at the end it prints each attempt
and the steps recomputed. With ``--min-ranks`` a lost host (fault ``lose``) gives an elastic restart
on the ranks left. Each job has an id (``--job ID`` resumes one; else a new one): its checkpoint folder
is its own. The ranks die with the supervisor, even if it is SIGKILLed (``heartbeat.started``).
Signals, full disks and the event log: chapter 10, section 4.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from minidist.resilience.attempts import Attempt, _dash, elastic_size, newest_good_checkpoint, recomputed
from minidist.resilience.checkpoint import folder
from minidist.resilience.faults import parse
from minidist.resilience.heartbeat import (
    ALIVE,
    STARTED,
    ExitOrder,
    blame,
    die_with_parent,
    heartbeat,
    read_heartbeats,
    stale_ranks,
)

__all__ = ["STARTED", "Attempt", "Stopped", "Supervisor", "blame", "elastic_size", "heartbeat", "main",
           "newest_good_checkpoint", "read_heartbeats", "recomputed", "stale_ranks"]


class Supervisor:
    def __init__(self, cmd, n: int, max_restarts: int, min_ranks: int | None, threads: bool, ckpt: str | None,
                 heartbeat_timeout: float, log: str | None, poll: float = 0.05, job: str | None = None):
        self.cmd, self.n, self.max_restarts = list(cmd), n, max_restarts
        self.job = job or folder.new_job_id()
        self.min_ranks, self.threads, self.ckpt = min_ranks, threads, ckpt
        self.timeout, self.poll, self.log_path = heartbeat_timeout, poll, log
        self.attempts: list[Attempt] = []
        self.t0 = time.time()
        self.work = tempfile.mkdtemp(prefix="minidist-launch-")
        if self.log_path is None:  # the job logs what it restored from: keep a log even if not asked
            self.log_path = os.path.join(self.work, "events.jsonl")

    def say(self, msg: str) -> None:
        print(f"[launch {time.time() - self.t0:7.2f}s] {msg}", flush=True)

    def log(self, **event) -> None:
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps({"t": time.time(), **event}) + "\n")

    def command(self, n: int) -> list[str]:
        if self.threads:
            return self.cmd + ["--ranks", str(n)]
        here = os.path.dirname(sys.executable)  # the mpich wheel puts mpirun beside python in a venv
        mpirun = shutil.which("mpirun") or shutil.which("mpirun", path=here) or shutil.which("mpiexec")
        if mpirun is None:
            raise SystemExit("minidist.launch: no mpirun on PATH (pip install mpich), or use --threads")
        return [mpirun, "-n", str(n)] + self.cmd

    def run(self) -> int:
        n = self.n
        self.say(f"job {self.job} (resume it with --job {self.job})")
        mark = folder.owner(self.ckpt) if self.ckpt else None
        if mark is not None and mark.get("job") != self.job:  # the job would refuse it: say so first
            self.say(folder.refusal(self.ckpt, mark.get("job"), self.job))
            return self.summary(1)
        for number in range(self.max_restarts + 1):
            resumed, problems = newest_good_checkpoint(self.ckpt, self.job) if number else (None, [])
            for p in problems:
                self.say(f"checkpoint check: {p}")
            a = Attempt(number, n, time.time(), resumed_from=resumed)
            self.attempts.append(a)
            known = self.ckpt and number  # attempt 0: the job decides whether it starts fresh
            where = f"(newest intact checkpoint in {self.ckpt}: step {resumed})" if known else ""
            self.say(f"attempt {number}: starting {n} ranks {where}".rstrip())
            self.log(event="start", attempt=number, ranks=n, resumed_from=resumed)
            code = self.watch(a)
            if code == 0:
                a.status = "ok"
                self.log(event="end", attempt=number, status="ok", last_step=a.last_step)
                self.say(f"attempt {number}: finished (exit 0)")
                return self.summary(0)
            self.log(event="failure", attempt=number, status=a.status, rank=a.failed_rank,
                     last_step=a.last_step)
            if a.disk_full:
                self.say(f"the job stopped: {a.disk_full}; a restart would fail the same way (free space, "
                         "or give the job another --ckpt folder); not restarting")
                return self.summary(1)
            if a.last_step is None and number and self.attempts[-2].last_step is None:
                self.say("the job failed twice before its first heartbeat: a configuration error or a "
                         "bug, not a fault a restart can fix (see its error above); giving up")
                return self.summary(1)
            if a.lost:
                left = n - len(a.lost)
                fits = elastic_size(self.n, left)
                if self.min_ranks is None or fits < self.min_ranks:
                    self.say(f"ranks {a.lost} lost; {left} left, below --min-ranks "
                             f"{self.min_ranks}: cannot restart")
                    return self.summary(1)
                n = fits
                self.say(f"ranks {a.lost} lost: elastic restart on {n} ranks")
        self.say(f"giving up after {self.max_restarts} restarts")
        return self.summary(1)

    def watch(self, a: Attempt) -> int:
        hb = os.path.join(self.work, f"attempt-{a.number}")
        os.makedirs(os.path.join(hb, ALIVE))
        order = ExitOrder(os.path.join(hb, ALIVE))  # which rank process ends first
        env = dict(os.environ, MINIDIST_HEARTBEAT_DIR=hb, MINIDIST_RESTART=str(a.number),
                   MINIDIST_WORLD_RANKS=str(a.ranks), MINIDIST_JOB_ID=self.job,
                   MINIDIST_SUPERVISOR_PID=str(os.getpid()))
        if self.log_path:
            env["MINIDIST_SUPERVISOR_LOG"] = self.log_path
        proc = subprocess.Popen(self.command(a.ranks), env=env, start_new_session=True,
                                preexec_fn=die_with_parent)  # mpirun (or the job) dies with the supervisor
        hung = None
        try:
            while (code := proc.poll()) is None:
                time.sleep(self.poll)
                stale = stale_ranks(read_heartbeats(hb), a.ranks, time.time(), self.timeout)
                if stale:
                    hung = blame(read_heartbeats(hb), stale)
                    silent = ", ".join(f"rank {r}: {s:.1f} s" for r, s in sorted(stale.items()))
                    self.say(f"no heartbeat for more than {self.timeout} s ({silent}): hung; killing the job")
                    _stop(proc)
                    code = -signal.SIGKILL
                    break
        except Stopped:  # SIGTERM / SIGINT to the supervisor: the job goes with it
            _stop(proc)
            a.end, a.status = time.time(), "stopped"
            raise
        finally:
            first = order.first()
            order.close()
        a.end = time.time()
        beats = read_heartbeats(hb)
        a.last_step = max((s for s, _ in beats.values() if s != STARTED), default=None)
        if code == 0:
            return 0
        notes = {int(f[len("fault-rank-"):]): open(os.path.join(hb, f)).read().strip()
                 for f in os.listdir(hb) if f.startswith("fault-rank-")}
        a.lost = sorted(r for r, note in notes.items() if note.startswith("lose"))
        full = sorted(open(os.path.join(hb, f)).read().strip() for f in os.listdir(hb)
                      if f.startswith(("diskfull-", "refused-")))
        other = [n for n in notes.values() if n.split(" ", 1)[0] in ("kill", "lose", "raise", "hang")]
        if full and not other and hung is None:  # the save failed and took the job down: not transient
            a.disk_full = full[0]
        if hung is not None:  # every rank waiting on the hung one goes silent too: a fault note knows better
            a.failed_rank = min(notes) if notes else hung
            step = beats.get(hung, (STARTED, 0))[0]
            why = "hung before its first step" if step == STARTED else f"hung at step {step}"
        elif notes:
            a.failed_rank = min(notes)
            why = notes[a.failed_rank]
        else:  # the rank that raised, else the first rank process to end, else the one behind
            errors = {int(f[len("error-rank-"):]): open(os.path.join(hb, f)).read().strip()
                      for f in os.listdir(hb) if f.startswith("error-rank-")}
            behind = sorted(beats.items(), key=lambda kv: (kv[1][0], kv[1][1]))
            a.failed_rank = min(errors) if errors else first if first is not None else \
                behind[0][0] if behind else None
            why = "exit status " + (f"{code}" if code > 0 else f"signal {-code}")
            why = f"{errors[a.failed_rank]}, {why}" if errors else \
                f"its process ended first, {why}" if first is not None else why
        a.status = "hung" if hung is not None else f"failed ({why})"
        steps = ", ".join(f"{r}:{s}" for r, (s, _) in sorted(beats.items()))
        self.say(f"attempt {a.number} FAILED after {a.end - a.start:.2f} s: rank {_dash(a.failed_rank)}, "
                 f"{why}; exit {code}; last step per rank {{{steps}}}")
        return code

    def _job_restores(self) -> None:
        """What each attempt really resumed from, if the job logged it (it may have used a faster tier
        than the disk directory the supervisor checks)."""
        if not self.log_path or not os.path.exists(self.log_path):
            return
        for line in open(self.log_path):
            e = json.loads(line)
            if e.get("event") == "restore" and e.get("attempt", -1) < len(self.attempts):
                self.attempts[e["attempt"]].resumed_from = e.get("step")
                self.attempts[e["attempt"]].tier = e.get("tier")

    def summary(self, code: int) -> int:
        self._job_restores()
        self.say("summary:")
        print(f"  {'attempt':>7} {'ranks':>5} {'seconds':>8} {'resumed':>14} {'last step':>9} "
              f"{'recomputed':>10}  "
              "outcome")
        per_attempt = recomputed(self.attempts)
        total = sum(max(lost, 0) for lost in per_attempt if lost is not None)
        for a, lost in zip(self.attempts, per_attempt):
            tier = f" ({a.tier})" if a.tier and a.resumed_from is not None else ""
            resumed = _dash(a.resumed_from) + tier
            cols = [a.number, a.ranks, f"{a.end - a.start:.2f}", resumed, _dash(a.last_step),
                    _dash(lost)]
            print(f"  {cols[0]:>7} {cols[1]:>5} {cols[2]:>8} {cols[3]:>14} {cols[4]:>9} {cols[5]:>10}  "
                  f"{a.status}")
        print(f"  restarts: {max(len(self.attempts) - 1, 0)}; steps recomputed: {total}; "
              f"wall time {time.time() - self.t0:.2f} s", flush=True)
        shutil.rmtree(self.work, ignore_errors=True)
        return code


def _stop(proc, grace: float = 2.0) -> None:
    """End the job's process group: SIGTERM first (mpirun then stops its ranks and frees their shared
    memory), SIGKILL whatever is left after ``grace`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Stopped(Exception):
    """The supervisor got SIGTERM or SIGINT: it stops the job (its whole process group) and exits."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m minidist.launch -n N [options] -- COMMAND ... "
                         "(the -- is required)")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m minidist.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--ranks", type=int, required=True, help="ranks to start")
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--min-ranks", type=int, default=None,
                    help="allow elastic restarts down to this many ranks")
    ap.add_argument("--threads", action="store_true", help="one process with --ranks N instead of mpirun")
    ap.add_argument("--ckpt", help="the job's checkpoint directory (to report what it resumes from)")
    ap.add_argument("--job", help="the job's id: an earlier job's, to resume it (default: a new id)")
    ap.add_argument("--heartbeat-timeout", type=float, default=60.0,
                    help="seconds without a heartbeat = hung (the first step may compile: JAX)")
    ap.add_argument("--fault", help="faults to inject (sets MINIDIST_FAULT for the job; see "
                    "minidist.resilience.faults)")
    ap.add_argument("--log", help="append events (JSON lines) here; the job sees it as "
                    "MINIDIST_SUPERVISOR_LOG")
    args = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd:
        raise SystemExit("minidist.launch: no command after --")
    if args.ranks < 1 or args.max_restarts < 0 or (args.min_ranks is not None and
                                                   not 1 <= args.min_ranks <= args.ranks):
        raise SystemExit(f"minidist.launch: need -n >= 1, --max-restarts >= 0 and 1 <= --min-ranks <= -n; "
                         f"got -n {args.ranks}, --max-restarts {args.max_restarts}, "
                         f"--min-ranks {args.min_ranks}")
    if not (math.isfinite(args.heartbeat_timeout) and args.heartbeat_timeout > 0):
        raise SystemExit(f"minidist.launch: --heartbeat-timeout must be a finite number of seconds > 0 "
                         f"(e.g. 60; the first step may compile), got {args.heartbeat_timeout}")
    if args.ckpt == "":
        raise SystemExit("minidist.launch: --ckpt '': give the job's checkpoint folder, or leave --ckpt out")
    if args.job is not None:
        try:
            folder.check_job_id(args.job)
        except ValueError as e:
            raise SystemExit(f"minidist.launch: --job: {e}") from None
    if cmd[0] == "python":
        cmd[0] = sys.executable
    if args.fault is not None:
        try:
            parse(args.fault)  # a typo fails here, not in the job
        except ValueError as e:
            raise SystemExit(f"minidist.launch: --fault: {e}") from None
        os.environ["MINIDIST_FAULT"] = args.fault
    sup = Supervisor(cmd, args.ranks, args.max_restarts, args.min_ranks, args.threads, args.ckpt,
                     args.heartbeat_timeout, args.log, job=args.job)
    previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return sup.run()
    except Stopped as e:
        sup.say(f"{e}: stopped the job (every rank) and exiting")
        sup.summary(128 + e.signum)
        return 128 + e.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
