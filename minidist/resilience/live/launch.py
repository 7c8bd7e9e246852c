"""Starting a live job, and starting the replacements of the groups it loses.

* ``run_threads(job_factory, groups, group_size, steps)`` -- every member a thread of this process
  (``--ranks N``); the coordinator runs on the calling thread; a lost group's replacement is a new
  set of threads with new member ids.
* ``run_agents(comm, ...)`` -- under ``mpirun``: each MPI rank is the *agent* of one slot (a position
  of one replica group). Rank 0 also runs the coordinator (a ``SocketHub``). Each agent starts its
  slot's worker process (the same command, with ``MINIDIST_LIVE`` set) and, when the coordinator asks,
  a replacement -- so a killed worker never takes the MPI job down with it. Agents beat for a
  supervisor (``python -m minidist.launch``) with the last committed step.
* ``serve_worker(job_factory)`` -- what such a worker runs: one member over the TCP fabric.

Both return a ``LiveRun`` on the coordinator's rank: the committed steps (``history``), the members'
results, the heals, each slot's processes or threads, and the error that ended the job, if any.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from minidist.comm.requests import CommError
from minidist.resilience.heartbeat import STARTED, heartbeat
from minidist.resilience.live.errors import GroupLeft, LiveError
from minidist.resilience.live.fabric import LiveWorld, comm_over
from minidist.resilience.live.faults import Killed, LiveInjector, parse
from minidist.resilience.live.links import QueueHub, SocketHub, connect, read_frame, serve, write_frame
from minidist.resilience.live.member import LiveMember
from minidist.resilience.live.quorum import Coordinator
from minidist.resilience.live.sockets import SocketComm, SocketWorld

ENV = "MINIDIST_LIVE"   # set for a worker: "host:port:group:pos:incarnation"
STOP_GRACE = 10.0       # seconds a finished worker has to exit before its agent kills it
LEFT = 3                # a worker's exit status when its group left the quorum
MPI_ENV = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCALNRANKS", "HYDRA_", "MPIR_", "MINIDIST_TRANSPORT")


@dataclass
class LiveRun:
    """What a live job did (on the coordinator's rank)."""
    history: list                                  # StepRecord per committed step
    finals: dict                                   # member -> its job's result
    heals: list                                    # (step, group, member, donor, donor group, bytes, s)
    error: Exception | None = None
    lives: dict = field(default_factory=dict)      # slot -> [(incarnation, pid or thread, how it ended)]
    member_errors: dict = field(default_factory=dict)
    events: list = field(default_factory=list)     # the coordinator's (time, "lost" | "healed", group, what)


def _coordinator(groups, group_size, steps, send, *, hang_timeout, rows, say, replace, newest_checkpoint,
                 heal_when=None):
    return Coordinator(groups, group_size, steps, send, hang_timeout=hang_timeout, rows=rows, say=say,
                       replace=replace, checkpoint=newest_checkpoint, heal_when=heal_when)


def _end(coord):
    """What a member still waiting hears when the job is over."""
    e = coord.error
    return ("fatal", str(e), getattr(e, "step", None), getattr(e, "checkpoint", None)) if e else ("finish",)


# -- threads ---------------------------------------------------------------------------------------

def run_threads(job_factory, groups: int, group_size: int, steps: int, *, faults: str = "",
                hang_timeout: float = 5.0, rows: int = 1, max_replacements: int = 4, checkpointer=None,
                newest_checkpoint=None, heal_when=None, resume: bool = False, say=print,
                timeout: float = 300.0) -> LiveRun:
    """Run a live job with every member a thread; ``job_factory(group, pos)`` makes a member's job.
    ``checkpointer(group_comm)``: the saving group's ``Checkpointer``; ``newest_checkpoint()``: the
    step a whole-job restart would resume from (named by ``LastGroupLost``); ``heal_when(step)``: may a
    replacement heal in that step (LocalSGD: only in a sync step); ``resume``: start from the newest
    checkpoint (after a whole-job failure)."""
    world, lives, errors, wanted = LiveWorld(), {}, {}, []
    hub = QueueHub(world)
    coord = _coordinator(groups, group_size, steps, hub.send, hang_timeout=hang_timeout, rows=rows, say=say,
                         replace=wanted.append, newest_checkpoint=newest_checkpoint, heal_when=heal_when)
    spec, threads, injectors, budget = parse(faults), [], [], [max_replacements]

    def body(member: LiveMember, m: int, slot: int, life: int):
        how = "finished"
        try:
            member.run()
        except GroupLeft:
            how = "left the quorum"
        except Killed as e:
            how = f"killed ({e})"
            world.lose(m, how)
            hub.inbox.put((m, ("lost", how)))
        except CommError as e:  # a member of its group failed mid-step: the group leaves
            how = f"left ({type(e).__name__}: {str(e).splitlines()[0]})"
            world.lose(m, how)
            hub.inbox.put((m, ("lost", how)))
        except LiveError as e:
            how = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            errors[m] = e
            world.lose(m, how)
            hub.inbox.put((m, ("lost", how)))
        except BaseException as e:  # a bug in the job: this member fails, its group leaves
            how = f"raised {type(e).__name__}: {e}"
            errors[m] = e
            sys.stderr.write(f"[live] member {m} (slot {slot}) raised:\n{traceback.format_exc()}")
            world.lose(m, how)
            hub.inbox.put((m, ("lost", how)))
        lives[slot][life] = (*lives[slot][life][:2], how)

    def start(g: int, pos: int) -> None:
        slot = g * group_size + pos
        incarnation = len(lives.setdefault(slot, []))
        m = world.add_member()
        inj = LiveInjector(spec, g, pos, incarnation, process=False, member=m)
        injectors.append(inj)
        if inj.unreachable:
            world.unreachable.add(m)
        member = LiveMember(hub.link(m), m, lambda members, ctx, m=m: comm_over(world, members, m, ctx),
                            g, pos, job_factory(g, pos), steps, faults=inj, checkpoint=checkpointer,
                            resume=resume, wait_timeout=timeout)
        t = threading.Thread(target=body, args=(member, m, slot, incarnation), daemon=True,
                             name=f"live-member-{m}")
        lives[slot].append((incarnation, t.name, "running"))
        threads.append(t)
        t.start()

    def replacements():
        while wanted:
            g = wanted.pop(0)
            if budget[0] <= 0:
                say(f"[live] group {g} lost and no replacement is left (max_replacements={max_replacements})")
                continue
            budget[0] -= 1
            for pos in range(group_size):
                start(g, pos)

    for g in range(groups):
        for pos in range(group_size):
            start(g, pos)
    serve(coord, hub.inbox, between=replacements)
    for link in hub.links.values():  # members still waiting (a late replacement): the job is over
        link.deliver(_end(coord))
    for inj in injectors:
        inj.release.set()
    for t in threads:
        t.join(timeout=10)
    return LiveRun(coord.history, coord.finals, coord.heal_log, coord.error, lives, errors, coord.events)


# -- processes: agents under mpirun, workers over TCP --------------------------------------------------

def _worker_env(address, g: int, pos: int, incarnation: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV)}
    env[ENV] = f"{address[0]}:{address[1]}:{g}:{pos}:{incarnation}"
    return env


def run_agents(comm, argv, groups: int, group_size: int, steps: int, *, hang_timeout: float = 5.0,
               rows: int = 1, max_replacements: int = 4, newest_checkpoint=None, heal_when=None,
               say=print) -> LiveRun | None:
    """Under MPI: this rank is the agent of slot ``comm.rank`` (group ``rank // group_size``); rank 0
    also runs the coordinator. ``argv``: the worker's command. Returns the ``LiveRun`` on rank 0."""
    if comm.size != groups * group_size:
        raise ValueError(f"rank {comm.rank}: {comm.size} MPI ranks, but {groups} groups of {group_size} "
                         f"need {groups * group_size}: one agent per slot")
    coord = hub = None
    budget = [max_replacements]
    if comm.rank == 0:
        hub = SocketHub()

        def replace(g):
            if budget[0] <= 0:
                say(f"[live] group {g} lost and no replacement is left (max_replacements={max_replacements})")
                return
            budget[0] -= 1
            for pos in range(group_size):
                hub.send(("agent", g * group_size + pos), ("replace",))
        coord = _coordinator(groups, group_size, steps, hub.send, hang_timeout=hang_timeout, rows=rows,
                             say=say, replace=replace, newest_checkpoint=newest_checkpoint,
                             heal_when=heal_when)

        told = [coord.step]

        def tell_agents():  # each committed step: the agents' heartbeats say how far the job got
            if coord.step != told[0]:
                told[0] = coord.step
                for slot in range(comm.size):
                    hub.send(("agent", slot), ("step", coord.step))

        def coordinate():
            serve(coord, hub.inbox, between=tell_agents)
            for m in list(hub.conns):  # members still waiting (a late replacement): the job is over
                hub.send(m, _end(coord))
            for slot in range(comm.size):  # every agent stops its workers
                hub.send(("agent", slot), ("stop",))
        server = threading.Thread(target=coordinate, daemon=True, name="live-coordinator")
        server.start()
    address = comm.bcast_obj(hub.address if hub is not None else None)
    lives = _agent(comm.rank, address, argv, group_size)
    if comm.rank == 0:
        server.join()
    all_lives = comm.gather_obj(lives, root=0)
    if comm.rank != 0:
        return None
    hub.close()
    return LiveRun(coord.history, coord.finals, coord.heal_log, coord.error,
                   {s: v for d in all_lives for s, v in d.items()}, {}, coord.events)


def _agent(slot: int, address, argv, group_size: int) -> dict:
    """Start this slot's worker and a warm spare (imported, parked on its stdin); when the coordinator
    asks, wake the spare as the replacement (and park a new one); stop when told. Returns
    {slot: [(incarnation, pid, how it ended)]}."""
    g, pos = divmod(slot, group_size)
    sock, lock, _ = connect(address, ("agent", slot))
    orders: list = []
    threading.Thread(target=lambda: [orders.append(m) for m in iter(lambda: read_frame(sock), None)],
                     daemon=True, name="live-agent-orders").start()
    lives, procs, step, beat = [], [], STARTED, 0.0

    def spare():
        return subprocess.Popen(argv, env=dict(_worker_env(address, g, pos, 0), MINIDIST_LIVE_SPARE="1"),
                                stdin=subprocess.PIPE, text=True)

    def ended(i, p):
        if lives[i][2] == "running":
            code = p.returncode
            lives[i][2] = {0: "finished", LEFT: "left the quorum"}.get(
                code, f"killed by signal {-code}" if code < 0 else f"exit {code}")

    procs.append(subprocess.Popen(argv, env=_worker_env(address, g, pos, 0)))
    lives.append([0, procs[0].pid, "running"])
    parked, told = spare(), set()
    while True:
        if procs[-1].poll() is not None and len(procs) not in told:  # say so: it may never have registered
            told.add(len(procs))
            write_frame(sock, ("exited", g, pos, len(procs) - 1, procs[-1].returncode), lock)
        while orders:
            order = orders.pop(0)
            if order[0] == "stop":
                parked.stdin.close()  # the spare reads end-of-file and exits
                for i, p in enumerate(procs):
                    try:
                        p.wait(timeout=STOP_GRACE)  # a worker that sent its result is exiting
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
                    ended(i, p)
                parked.wait()
                sock.close()
                return {slot: [tuple(x) for x in lives]}
            if order[0] == "step":
                step, beat = order[1], 0.0  # beat now
            if order[0] == "replace":
                old = procs[-1]
                if old.poll() is None:  # still there (hung, or leaving): it must not come back
                    old.kill()
                    old.wait()
                    lives[-1][2] = "ended by its agent (its group left the quorum)"
                ended(len(procs) - 1, old)
                parked.stdin.write(f"{len(procs)}\n")  # wake the spare: it is the next incarnation
                parked.stdin.flush()
                procs.append(parked)
                lives.append([len(procs) - 1, parked.pid, "running"])
                parked = spare()
        if time.monotonic() - beat > 1.0:  # a supervisor (python -m minidist.launch) sees the job alive
            heartbeat(slot, step)
            beat = time.monotonic()
        time.sleep(0.02)


def serve_worker(job_factory, steps: int, faults: str = "", checkpointer=None, resume: bool = False,
                 wait_timeout: float = 300.0) -> int:
    """A worker process (``MINIDIST_LIVE`` set by its agent): one member over TCP. Exit status 0 when
    it finished, ``LEFT`` when its group left the quorum, 1 on an error that ends the job."""
    host, port, g, pos, incarnation = os.environ[ENV].split(":")
    g, pos, incarnation = int(g), int(pos), int(incarnation)
    if os.environ.get("MINIDIST_LIVE_SPARE"):  # a warm spare: imported, parked until its agent wakes it
        line = sys.stdin.readline()
        if not line:
            return 0
        incarnation = int(line)
    world = SocketWorld()
    _, _, link = connect((host, int(port)), ("member",), world)
    inj = LiveInjector(parse(faults), g, pos, incarnation, process=True, member=world.member)
    if inj.unreachable:
        world.refuse()
    member = LiveMember(link, world.member,
                        lambda members, ctx: comm_over(world, members, world.member, ctx, cls=SocketComm),
                        g, pos, job_factory(g, pos), steps, faults=inj, address=world.address,
                        checkpoint=checkpointer, resume=resume, wait_timeout=wait_timeout)
    try:
        member.run()
    except (GroupLeft, CommError):  # CommError: a member of this group died mid-step; the group leaves
        return LEFT
    except LiveError as e:
        sys.stderr.write(f"[live] member {world.member} (group {g}): {type(e).__name__}: {e}\n")
        return 1
    finally:
        world.close()
    return 0
