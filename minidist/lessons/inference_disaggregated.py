"""Lesson 9, part 6: prefill and decode on separate ranks, beside every rank doing both.

Two workloads at one arrival rate -- short prompts, and long ones (most of the context) -- served
disaggregated (the KV cache sent from prefill to decode ranks, bytes beside ``kv_message_bytes``)
and colocated; the same tokens either way. Each run's steady-state TPOT beside its formula, from
step costs measured on the same clock: colocated d / (1 - rho) (rho: the share of a rank's time
its prefills take), disaggregated d + (x + d/2) / (n - 1) (x: the cache's trip over the link).
"""

from __future__ import annotations

import numpy as np

from minidist.comm import measure
from minidist.infer import Request, Scheduler
from minidist.infer.colocated import colocated_serve
from minidist.infer.disaggregated import disaggregated_serve, kv_message_bytes
from minidist.lessons.cli import rprint
from minidist.lessons.inference_kv import PROMPTS, enc
from minidist.trace.spans import now

REQUESTS, NEW, SLOTS = 24, 12, 8  # requests per workload, tokens each, decode slots per rank
RHO = 0.4  # arrivals as fast as keeps a colocated rank this busy prefilling long prompts
TOL = 0.15  # a measured TPOT within 15% of its formula's range


def workloads(args) -> dict:
    """Short prompts (the lesson's questions) and long ones (the context less the answer)."""
    long_text = enc(" ".join(PROMPTS))[:args.block - NEW - 1]
    return {"short": [enc(PROMPTS[i % len(PROMPTS)]) for i in range(REQUESTS)],
            "long": [long_text] * REQUESTS}


def step_costs(model, loads: dict, slots: int) -> tuple:
    """On this rank's clock: ({workload: mean seconds of a Scheduler step prefilling one of its
    prompts alone}, [seconds of a decode step with b running, b = 1..slots])."""
    prefill = {}
    for name, prompts in loads.items():
        times = []
        for q in sorted(set(map(tuple, prompts))):
            s = Scheduler(model, max_batch=1)
            s.submit(Request(0, list(q), 2))
            t = now()
            s.step()
            times.append(now() - t)
        prefill[name] = float(np.mean(times))
    decode = []
    for b in range(1, slots + 1):
        s = Scheduler(model, max_batch=b)
        for i in range(b):
            s.submit(Request(i, loads["short"][0], 4))
        s.step()
        t = now()
        s.step(), s.step()
        decode.append((now() - t) / 2)
    return prefill, decode


def colocated_tpot(p: float, d: float, period: float) -> float:
    """TPOT of a colocated request when one arrives on its rank every ``period`` seconds: its NEW - 1
    decode steps (d each) also carry the prefills (p each) of the m later arrivals that land inside
    its life L = (NEW - 1)·d + m·p (each request's the same: the arrivals are evenly spaced)."""
    m = 0
    while m < REQUESTS and (m + 1) * period < p + (NEW - 1) * d + m * p:
        m += 1
    return d + m * p / (NEW - 1)


def steady_tpot(sv, arrivals) -> float:
    """Mean TPOT of the requests that finished while others still arrived (the last ones see an
    emptying system)."""
    done = {i: arrivals[i] + sv.ttft[i] + (NEW - 1) * sv.tpot[i] for i in sv.tpot}
    return float(np.mean([sv.tpot[i] for i in done if done[i] <= arrivals[-1]] or list(sv.tpot.values())))


def disaggregation(comm, model, args):
    if args.disaggregate is None:
        rprint(comm, "\n6. disaggregated serving: needs >= 2 ranks (--disaggregate P:D)")
        return True
    p, d = args.disaggregate
    loads, size = workloads(args), comm.size
    step_costs(model, {"short": loads["short"][:1]}, 1)  # warm up
    costs = comm.allgather_obj(step_costs(model, loads, SLOTS))  # every rank at once, as they will serve
    prefill = {k: float(np.mean([c[0][k] for c in costs])) for k in loads}
    decode = list(np.mean([c[1] for c in costs], axis=0))
    gap = prefill["long"] / (size * RHO)
    arrivals = [gap * i for i in range(REQUESTS)]
    runs, sent = {}, {}
    for name, prompts in loads.items():
        reqs = [Request(i, q, NEW) for i, q in enumerate(prompts)]
        colo = colocated_serve(comm, model, reqs, arrivals, max_batch=SLOTS)
        with measure(comm) as m:
            dis = disaggregated_serve(comm, model, reqs, arrivals, prefill_ranks=p, max_batch=SLOTS)
        runs[name], sent[name] = (reqs, colo, dis), comm.gather_obj(m.bytes_sent, root=0)
    if comm.rank != 0:
        return True
    clock = comm.clock
    exact = clock is not None and clock.device is not None  # CPU time moves with the machine's load
    u, unit = (1e6, "us") if exact else (1e3, "ms")  # a device model's steps are microseconds, a CPU's ms
    print(f"\n6. disaggregated serving: {REQUESTS} requests a workload, {NEW} new tokens each, one every "
          f"{gap * u:.2f} {unit}, {SLOTS} slots a rank, {size} ranks "
          f"({'virtual' if clock else 'wall'} clock)")
    print(f"   step costs: prefilling a long prompt p = {prefill['long'] * u:.2f} {unit}, a short one "
          f"{prefill['short'] * u:.2f}; a decode step d = {decode[0] * u:.2f} with 1 running, "
          f"{decode[-1] * u:.2f} with {SLOTS}")
    print(f"   one arrival every p / ({size} ranks x {RHO}): colocated, prefilling long prompts takes "
          f"{RHO:.0%} of each rank's time")
    print(f"   {'':34s}{'TTFT p50':>10s}{'p90':>9s}{'TPOT p50':>10s}{'p90':>9s}{'steady':>9s}  "
          f"formula ({unit})")
    ok, tpot, want = True, {}, {}
    for name, (reqs, colo, dis) in runs.items():
        t_len = float(np.mean([len(r.prompt) for r in reqs]))
        x = clock.link.alpha + kv_message_bytes(model.config, 1) * t_len * args.kv_heads / args.heads \
            / clock.link.bandwidth if clock else 0.0
        want[name, "colocated"] = [colocated_tpot(prefill[name], dd, size * gap)
                                   for dd in (decode[0], decode[-1])]
        want[name, "disaggregated"] = [decode[0] + x / (NEW - 1), decode[-1] + (x + decode[-1]) / (NEW - 1)]
        lens = sorted({len(r.prompt) for r in reqs})
        print(f"   {name} prompts ({lens[0]}-{lens[-1]} tokens)" + (f", the cache's trip x = "
                                                                 f"{x * 1e6:.1f} us" if clock else ""))
        for label, sv, what in ((f"colocated ({size} x both)", colo, "colocated"),
                                (f"disaggregated ({p} : {d})", dis, "disaggregated")):
            s, (lo, hi) = sv.summary(), want[name, what]
            tpot[name, what] = steady_tpot(sv, arrivals)
            inside = (1 - TOL) * lo <= tpot[name, what] <= (1 + TOL) * hi
            ok &= inside or not exact
            print(f"     {label:32s}{s['ttft_p50'] * u:10.2f}{s['ttft_p90'] * u:9.2f}"
                  f"{s['tpot_p50'] * u:10.2f}{s['tpot_p90'] * u:9.2f}{tpot[name, what] * u:9.2f}  "
                  f"{lo * u:.2f}-{hi * u:.2f}"
                  + ("" if inside else " (outside)"))
    print("   formulas: colocated d + m·p / (n - 1), m the later arrivals on its rank during its n - 1 "
          "decode steps; disaggregated d + (x + up to a step) / (n - 1)")
    (dlo, dhi), (clo, chi) = want["long", "disaggregated"], want["long", "colocated"]
    lower = tpot["long", "disaggregated"] < tpot["long", "colocated"]
    said = "lower" if dhi < clo else "higher" if dlo > chi else "too close to call"
    line = (f"   long prompts: disaggregated steady TPOT {tpot['long', 'disaggregated'] * u:.2f} {unit} "
            f"{'<' if lower else '>='} colocated {tpot['long', 'colocated'] * u:.2f}; formulas: {said}")
    if exact:
        ok &= said == "too close to call" or lower == (said == "lower")
        print(f"{line}; each within {TOL:.0%} of its formula: {'PASS' if ok else 'FAIL'}")
    else:
        print(f"{line} (shown, not checked: {'CPU' if clock else 'wall'} time moves with the machine's "
              "load; --clock virtual --device makes it exact)")
    good = all(dis.outputs == colo.outputs for _, colo, dis in runs.values())
    for name, (reqs, _, _) in runs.items():
        bytes_ = [sum(kv_message_bytes(model.config, len(r.prompt)) * args.kv_heads // args.heads
                      for i, r in enumerate(reqs) if i % p == rank) if rank < p else 0
                  for rank in range(size)]
        good &= sent[name] == bytes_
        print(f"   {name}: KV caches sent per rank {', '.join(f'{b:,}' for b in sent[name])}; formula sum "
              f"2·L·T·K·(d/H)·4 over each prefill rank's prompts: {', '.join(f'{b:,}' for b in bytes_)}")
    print(f"   serial twin: disaggregated == colocated token for token, bytes == formula: "
          f"{'PASS' if good else 'FAIL'}")
    return ok and good
