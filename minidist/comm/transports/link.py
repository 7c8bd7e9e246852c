"""An emulated network link: every message waits alpha + bytes / bandwidth before it leaves.

On one machine the "network" is memory, so sending fewer bytes never pays. Setting

    MINIDIST_LINK="alpha_us=50,gbps=1"      # or set_link("alpha_us=50,gbps=1"), or a lesson's --link

makes every communicator created afterwards (threads or MPI, their private channels and groups too)
delay each message it sends by ``alpha + nbytes / bandwidth`` -- the alpha-beta model of chapter 2,
now true by construction -- so a 1 Gb/s link between datacenters or a 100 Gb/s NIC can be
emulated, and ``predict_all_reduce`` (the cost model's round and byte counts) checked against it.

The sender sleeps (its outgoing link is busy), so the messages of one rank go one after another and
different ranks' messages in parallel, as on a full-duplex network. Each communicator holds the
link it was created with (``comm.link``); a transport's send pays ``comm.link.pause(nbytes)`` before
the message leaves, and without a link (``None``) sends cost nothing extra.
Keys: ``alpha_us`` (default 0), and one of ``gbps`` / ``mbps`` (bits per second) or ``gBps`` (bytes).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from minidist.comm import waiting
from minidist.comm.cost import all_reduce_counts


@dataclass(frozen=True)
class Link:
    alpha: float        # seconds per message
    bandwidth: float    # bytes per second

    def delay(self, nbytes: int) -> float:
        """Seconds one message of ``nbytes`` occupies the link."""
        return self.alpha + nbytes / self.bandwidth

    def predict_all_reduce(self, algorithm: str, nbytes: int, p: int) -> float:
        """The alpha-beta prediction for one all-reduce on this link: rounds·alpha + bytes sent/bandwidth
        (rounds and bytes from ``cost.all_reduce_counts``: one message per round per rank)."""
        rounds, _, sent, _ = all_reduce_counts(algorithm, nbytes, p)
        return rounds * self.alpha + sent / self.bandwidth

    def pause(self, nbytes: int) -> None:
        if not getattr(waiting._thread, "fine", False):
            waiting._fine_sleeps()  # 1 us timer slack: a 50 us sleep is not rounded up by 50 us
        time.sleep(self.delay(nbytes))

    def __str__(self):
        return f"alpha_us={self.alpha * 1e6:g},gbps={self.bandwidth * 8 / 1e9:g}"


_UNITS = {"gbps": 1e9 / 8, "mbps": 1e6 / 8, "gBps": 1e9}


def parse_link(spec: str | None) -> Link | None:
    """"alpha_us=50,gbps=1" -> Link(50e-6, 1.25e8); "" or None or "off" -> None."""
    if not spec or spec.strip() in ("off", "none"):
        return None
    alpha, bandwidth = 0.0, None
    for item in spec.split(","):
        key, _, value = item.strip().partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is None or number < 0 or key not in ("alpha_us", *_UNITS):
            raise ValueError(f"link spec {spec!r}: bad item {item!r}; expected e.g. 'alpha_us=50,gbps=1' "
                             f"(keys alpha_us and one of {', '.join(_UNITS)}, numbers >= 0)")
        if key == "alpha_us":
            alpha = number * 1e-6
        else:
            bandwidth = number * _UNITS[key]
    if not bandwidth:
        raise ValueError(f"link spec {spec!r}: needs a bandwidth > 0 (e.g. gbps=1)")
    return Link(alpha, bandwidth)


_CURRENT: list = []  # [Link | None]: the process's link, read from MINIDIST_LINK once


def current_link() -> Link | None:
    if not _CURRENT:
        _CURRENT.append(parse_link(os.environ.get("MINIDIST_LINK")))
    return _CURRENT[0]


def set_link(spec) -> Link | None:
    """Use ``spec`` (a string, a Link, or None) for communicators created from now on; returns the
    previous link (to restore it)."""
    previous = current_link()
    _CURRENT[0] = parse_link(spec) if isinstance(spec, str) or spec is None else spec
    return previous
