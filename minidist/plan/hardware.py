"""Hardware constants the planner uses, each with where it came from.

One `Hardware` per accelerator system: the chip (peak dense bf16 FLOP/s, HBM capacity and bandwidth),
the fast domain it sits in (`intra`: NVLink/NVSwitch inside a node, or ICI across a TPU slice) and
the network between domains (`inter`: InfiniBand/RoCE per GPU, or DCN per TPU chip). Links are
`Link(bandwidth, latency)`: bytes/s per chip, per direction; seconds per message round.

`gemm_efficiency` (0.80 GPU, 0.85 TPU) is the main number that is not a datasheet figure; the TPU
v4/v5e DCN per chip is the other assumption. `python -m minidist.calibrate` measures this machine
instead, and `here()` reads it back.

Sources, the keys each preset's `sources` names (the full citations, and which number comes from
which, are in lessons/00-estimates.md, section 5): [A100] [H100] [B200] NVIDIA datasheets 2021-24;
[MEG21] Narayanan et al. 2021 (Megatron-LM), Sec. 5; [LLAMA3] Llama Team 2024, Sec. 3.3; [TPUv4]
Jouppi et al. 2023; [v5e] [v5p] Google Cloud TPU docs; [SB] Austin et al. 2025, "How to Scale Your
Model"; [PCIe] PCI-SIG; [NVMe] Samsung 990 PRO datasheet; [GEMM] cuBLAS/Megatron GEMM results, [SB].
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

GB = 1e9


@dataclass(frozen=True)
class Link:
    """A link as one chip sees it: bytes/s each way, seconds per message round."""
    bandwidth: float
    latency: float
    name: str = ""


@dataclass(frozen=True)
class Crowd:
    """`ranks` MPI processes at once on this machine, as calibrate's mpirun probe measured them
    (`minidist.plan.calibrate_mpi`): the cores' worth of minidist work they get together, and per
    all-reduce algorithm the wall time of its rounds and bytes with all of them running it --
    `fg` called between computations (tensor parallel), `bg` on the communication thread (DDP) --
    and `python`: what each op loses besides, as extra seconds per second of a rank's Python alone
    (switches and cold caches come per op, not per FLOP)."""
    ranks: int
    cores: float
    links: dict = field(compare=False)  # algorithm -> {"fg": Link, "bg": Link}
    python: float = 0.0

    def link(self, algorithm: str, background: bool) -> Link:
        by = self.links.get(algorithm) or self.links["ring"]
        return by["bg" if background else "fg"]


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float            # dense bf16 (or the dtype trained in) FLOP/s per chip
    hbm_bytes: float             # memory per chip
    hbm_bandwidth: float         # bytes/s
    intra: Link                  # inside the fast domain (node / TPU slice)
    inter: Link                  # between fast domains
    chips_per_domain: int        # chips in one fast domain (GPUs per node; a TPU slice's chips)
    gemm_efficiency: float = 0.8  # share of peak a large matmul reaches [GEMM]
    host_link: Link | None = None  # to host memory (offload)
    disk: Link | None = None       # to local NVMe (offload)
    op_overhead: float = 0.0       # seconds per op (forward + backward) outside the math: Python, dispatch
    cores: float = 0               # cores the ranks share (0: one chip per rank, nothing shared); for
                                   # this machine, the cores' worth calibrate found free
    cores_crowded: float = 0       # thread ranks, once they outnumber the CPUs: the cores' worth they get
    cpus: int = 0                  # this machine's CPUs (0: not a shared machine)
    kernels: dict | None = field(default=None, compare=False)  # measured minidist op rates (calibrate)
    gil: bool = False              # ranks are threads of one Python process (their Python runs in turn)
    transport: str = ""            # "threads" or "mpi" for this machine ("": a preset's own collectives)
    crowds: tuple = ()             # MPI processes here: a `Crowd` per probed process count (calibrate)
    threads: tuple = ()            # thread ranks here: (ranks, cores' worth) per measured count (calibrate)
    cores_one: float = 0           # here: the share of a core one rank alone gets (1 on a quiet machine)
    sources: tuple = field(default=(), compare=False)
    fp8_flops: float = 0.0         # dense FP8 FLOP/s per chip (0: no FP8 tensor cores listed)

    def with_(self, **changes) -> Hardware:
        return replace(self, **changes)

    def crowd(self, ranks: int) -> Crowd | None:
        """The probe for `ranks` processes: the measured one, the next larger one measured (between
        probes the cores' worth and latency of the larger count, a little pessimistic), or beyond
        the largest its cores' worth with every round ranks / largest times as long (the partner's
        turn comes round that much later). None: nothing measured, or a single rank."""
        if not self.crowds or ranks <= 1:
            return None
        for c in sorted(self.crowds, key=lambda c: c.ranks):
            if c.ranks >= ranks:
                return c
        k = ranks / c.ranks
        links = {a: {w: Link(lk.bandwidth, lk.latency * k, lk.name) for w, lk in by.items()}
                 for a, by in c.links.items()}
        return Crowd(ranks, c.cores, links, c.python)

    def thread_cores(self, ranks: int) -> float:
        """The cores' worth `ranks` thread ranks get together: calibrate's measurement for that many
        (`threads`: (ranks, cores) pairs), else the next larger count measured; past the largest, or
        from an older calibration, `cores_crowded` once they outnumber the CPUs, else `cores`."""
        for n, cores in sorted(self.threads):
            if n >= ranks:
                return cores
        if self.cpus and ranks > self.cpus and self.cores_crowded:
            return self.cores_crowded
        return self.cores


PCIE4 = Link(32 * GB, 5e-6, "PCIe Gen4 x16")
PCIE5 = Link(64 * GB, 5e-6, "PCIe Gen5 x16")
NVME = Link(7.45 * GB, 1e-4, "NVMe PCIe4 x4")

A100 = Hardware("A100-SXM4-80GB", 312e12, 80 * GB, 2039 * GB,
                intra=Link(300 * GB, 5e-6, "NVLink 3"), inter=Link(25 * GB, 1e-5, "HDR InfiniBand"),
                chips_per_domain=8, gemm_efficiency=0.8, host_link=PCIE4, disk=NVME,
                sources=("A100", "MEG21", "GEMM"))
H100 = Hardware("H100-SXM5-80GB", 989e12, 80 * GB, 3350 * GB,
                intra=Link(450 * GB, 5e-6, "NVLink 4"), inter=Link(50 * GB, 1e-5, "400G InfiniBand/RoCE"),
                chips_per_domain=8, gemm_efficiency=0.8, host_link=PCIE5, disk=NVME,
                sources=("H100", "LLAMA3", "GEMM"), fp8_flops=1979e12)
B200 = Hardware("B200", 2250e12, 180 * GB, 8000 * GB,
                intra=Link(900 * GB, 5e-6, "NVLink 5"), inter=Link(50 * GB, 1e-5, "400G InfiniBand"),
                chips_per_domain=8, gemm_efficiency=0.8, host_link=PCIE5, disk=NVME,
                sources=("B200", "GEMM"), fp8_flops=4500e12)
# TPUs: a ring over one torus axis uses 2 links (both neighbours) -> 2 x per-link bandwidth each way
TPU_V4 = Hardware("TPU v4", 275e12, 32 * 2**30, 1200 * GB,
                  intra=Link(2 * 50 * GB, 1e-6, "ICI (one torus axis)"), inter=Link(3.1 * GB, 1e-5, "DCN"),
                  chips_per_domain=4096, gemm_efficiency=0.85, host_link=PCIE4,
                  sources=("TPUv4", "SB", "GEMM"))
TPU_V5E = Hardware("TPU v5e", 197e12, 16 * 2**30, 819 * GB,
                   intra=Link(2 * 50 * GB, 1e-6, "ICI (one torus axis)"), inter=Link(3.1 * GB, 1e-5, "DCN"),
                   chips_per_domain=256, gemm_efficiency=0.85, host_link=PCIE4,
                   sources=("v5e", "SB", "GEMM"))
TPU_V5P = Hardware("TPU v5p", 459e12, 95 * 2**30, 2765 * GB,
                   intra=Link(2 * 100 * GB, 1e-6, "ICI (one torus axis)"),
                   inter=Link(50e9 / 8, 1e-5, "DCN"),
                   chips_per_domain=8960, gemm_efficiency=0.85, host_link=PCIE5,
                   sources=("v5p", "SB", "GEMM"))

PRESETS = {"a100": A100, "h100": H100, "b200": B200, "tpu-v4": TPU_V4, "tpu-v5e": TPU_V5E, "tpu-v5p": TPU_V5P}

CALIBRATION_PATH = os.path.join(os.path.expanduser("~"), ".cache", "minidist", "calibration.json")


def _crowd(e: dict) -> Crowd:
    """A Crowd from calibrate's "processes" entry: ranks, cores, links {alg: {"fg"/"bg": [alpha, beta]}}."""
    links = {a: {w: Link(1.0 / beta, alpha, f"mpi {a}, {e['ranks']} processes ({w})")
                 for w, (alpha, beta) in by.items()} for a, by in e["links"].items()}
    return Crowd(e["ranks"], e["cores"], links, e.get("python", 0.0))


def here(path: str | None = None, transport: str = "threads") -> Hardware:
    """This machine, from the calibration file `python -m minidist.calibrate` wrote (one rank = one
    chip; the 'intra' link is the threads transport's measured all-reduce alpha/beta). `transport`:
    "threads" (ranks share one Python: the cores they really get, measured per rank count in
    `threads`, from older calibrations `cores_threads`, or `cores_threads_crowded` once they
    outnumber the CPUs; their ops' fixed costs add up) or "mpi"
    (one process per rank: the mpirun probe's `crowds` -- cores' worth and all-reduce links per
    process count -- or, from a calibration without it, `cores_free` and the threads link)."""
    path = path or CALIBRATION_PATH
    if not os.path.exists(path):
        raise FileNotFoundError(f"no calibration at {path}: run `python -m minidist.calibrate` first "
                                "(it measures this machine once, ~20 s)")
    with open(path) as f:
        c = json.load(f)
    crowds = () if transport == "threads" else tuple(_crowd(e) for e in c.get("processes", ()))
    link = Link(1.0 / c["beta"], c["alpha"],  # the threads link: MPI groups use `crowds`' own links
                "threads transport" + (" (mpi groups: the probe's link per process count)" if crowds else ""))
    counts = tuple((e["ranks"], e["cores"]) for e in c.get("threads", ()))
    threads = counts if transport == "threads" else ()
    one = min((cores for n, cores in counts if n == 1), default=0.0)  # one rank: one thread, GIL or not
    return Hardware(f"here ({c.get('cpu', 'this CPU')})", c["flops"], c.get("memory_bytes", 8 * GB),
                    c["mem_bandwidth"], intra=link, inter=link, chips_per_domain=10**6,
                    gemm_efficiency=1.0, op_overhead=c["op_overhead"],
                    cores=c.get("cores_threads" if transport == "threads" else "cores_free", c["cores"]),
                    cores_crowded=c.get("cores_threads_crowded", 0.0), cpus=c["cores"],
                    kernels=c.get("kernels"), gil=transport == "threads", transport=transport, crowds=crowds,
                    threads=threads, cores_one=one, sources=("calibrate",))


def get(name: str) -> Hardware:
    """A preset by name (see PRESETS) or "here"."""
    if name == "here":
        return here()
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(PRESETS)} or 'here'") from None
