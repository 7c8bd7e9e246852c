"""The control plane: the small messages between members, launchers and the coordinator.

Threads: ``QueueHub`` (queues in one process). Processes: ``SocketHub``, a TCP server the members and
the launchers' agents connect to (one connection each, pickled frames); a connection that closes is a
lost member -- that is how the death of a killed process reaches the coordinator within milliseconds.

A member's ``MemberLink`` applies ``("lost", member, why)`` and ``("revoke", ctx)`` to its fabric the
moment they arrive (on the sender's thread, or a reader thread), so a rank blocked in a receive is
released at once; every other message waits in ``inbox`` for the member's own loop. ``serve`` is the
coordinator's loop: one thread feeds it every event, in order, and ticks its heartbeat check.
"""

from __future__ import annotations

import pickle
import queue
import socket
import struct
import threading
import traceback

from minidist.resilience.live.errors import LiveError


def write_frame(sock, obj, lock) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        sock.sendall(struct.pack("<Q", len(data)) + data)


def accept_forever(server, serve, name: str) -> None:
    """Hand each connection ``server`` accepts to ``serve`` on a thread of its own, until it closes."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(conn,), daemon=True, name=name).start()


def recv_exact(sock, n: int):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf


def read_frame(sock):
    """The next object on ``sock``, or None when the other end closed it."""
    try:
        head = recv_exact(sock, 8)
        if head is None:
            return None
        body = recv_exact(sock, struct.unpack("<Q", head)[0])
    except OSError:
        return None
    return None if body is None else pickle.loads(body)


class MemberLink:
    """A member's end of the control plane (see the module docstring)."""

    def __init__(self, send, fabric):
        self._send, self.fabric, self.inbox = send, fabric, queue.Queue()

    def send(self, msg) -> None:
        self._send(msg)

    def deliver(self, msg) -> None:
        if msg[0] == "lost":
            self.fabric.lose(msg[1], msg[2])
        elif msg[0] == "revoke":
            self.fabric.revoke(msg[1])
        else:
            self.inbox.put(msg)

    def recv(self, timeout: float, what: str):
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise LiveError(f"no word from the coordinator for {timeout:g} s while waiting for "
                            f"{what}") from None


class QueueHub:
    """The threads transport's control plane: the coordinator's inbox and each member's link."""

    def __init__(self, world):
        self.world, self.inbox, self.links = world, queue.Queue(), {}

    def link(self, member: int) -> MemberLink:
        link = self.links[member] = MemberLink(lambda msg: self.inbox.put((member, msg)), self.world)
        return link

    def send(self, member: int, msg) -> None:
        link = self.links.get(member)
        if link is not None:
            link.deliver(msg)

    def close(self) -> None:
        pass


class SocketHub:
    """The coordinator's TCP server: members connect and get an id; agents connect as launchers."""

    def __init__(self, host: str = "127.0.0.1"):
        self.inbox, self.conns, self.agents, self.addresses = queue.Queue(), {}, {}, {}
        self.server = socket.create_server((host, 0))
        self.address = self.server.getsockname()[:2]
        self.next_member, self.lock = 0, threading.Lock()
        threading.Thread(target=accept_forever, args=(self.server, self._serve, "live-hub-conn"), daemon=True,
                         name="live-hub-accept").start()


    def _serve(self, conn) -> None:
        hello, lock = read_frame(conn), threading.Lock()
        if hello is None:
            return
        if hello[0] == "agent":
            self.agents[hello[1]] = (conn, lock)
            src = ("agent", hello[1])
        else:
            with self.lock:
                src, self.next_member = self.next_member, self.next_member + 1
            self.conns[src] = (conn, lock)
            write_frame(conn, ("id", src), lock)
        while (msg := read_frame(conn)) is not None:
            if msg[0] == "register" and len(msg) > 3:
                self.addresses[src] = msg[3]
            self.inbox.put((src, msg))
        if not isinstance(src, tuple):
            self.inbox.put((src, ("lost", "ended (its connection closed: the process died)")))

    def send(self, member, msg) -> None:
        if msg[0] in ("welcome", "quorum"):
            msg = (*msg, dict(self.addresses))
        target = self.agents.get(member[1]) if isinstance(member, tuple) else self.conns.get(member)
        if target is not None:
            try:
                write_frame(target[0], msg, target[1])
            except OSError:
                pass  # its connection is gone: the reader reports it lost

    def close(self) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.close()
        for conn, _ in list(self.conns.values()) + list(self.agents.values()):
            try:
                conn.close()
            except OSError:
                pass


def connect(address, hello, fabric=None):
    """Connect to a ``SocketHub``: (socket, lock, MemberLink or None). A member (``hello`` =
    ``("member",)``) learns its id, sets ``fabric.member`` and gets a link whose reader thread delivers."""
    sock = socket.create_connection(tuple(address), timeout=30)
    sock.settimeout(None)
    lock = threading.Lock()
    write_frame(sock, hello, lock)
    if hello[0] != "member":
        return sock, lock, None
    got = read_frame(sock)
    fabric.member = got[1]
    link = MemberLink(lambda msg: write_frame(sock, msg, lock), fabric)

    def reader():
        while (msg := read_frame(sock)) is not None:
            if msg[0] in ("welcome", "quorum"):
                fabric.addresses.update(msg[-1])
                msg = msg[:-1]
            link.deliver(msg)
        link.inbox.put(("fatal", "the coordinator's connection closed", None, None))

    threading.Thread(target=reader, daemon=True, name="live-member-control").start()
    return sock, lock, link


def serve(coord, inbox, tick: float = 0.05, between=None) -> None:
    """The coordinator's loop: every event from ``inbox`` -- ``(source, message)`` -- in order, the
    heartbeat check every ``tick`` seconds, ``between()`` after each (a launcher's replacements)."""
    handlers = {"register": lambda s, m: coord.register(s, m[1], m[2]),
                "ready": lambda s, m: coord.ready_for(s, m[1]),
                "beat": lambda s, m: coord.beat(s, m[1], m[2]),
                "report": lambda s, m: coord.report(s, *m[1:]),
                "done": lambda s, m: coord.finished(s, m[1]),
                "lost": lambda s, m: coord.lost(s, m[1]),
                "healed": lambda s, m: coord.healed(s, *m[1:]),
                "exited": lambda s, m: coord.exited(*m[1:])}
    while not coord.done:
        try:
            src, msg = inbox.get(timeout=tick)
        except queue.Empty:
            src = msg = None
        try:
            if msg is not None and msg[0] in handlers:
                handlers[msg[0]](src, msg)
            coord.tick()
            if between is not None:
                between()
        except Exception as e:  # a bug here must end the job with its error, not leave every member waiting
            traceback.print_exc()
            coord._fatal(f"the coordinator failed on {str(msg)[:80]}: {type(e).__name__}: {e}", lost=False)
