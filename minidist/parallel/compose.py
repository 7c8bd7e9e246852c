"""Which techniques combine: the one table the library checks, the tests train and the README prints.

Every pair of the techniques below either trains to the same parameters as its serial twin
(``tests/parallel/test_compose.py`` builds each supported pair through ``parallelize``) or is
*refused*: ``parallelize`` raises a ``ValueError`` naming both techniques and the reason before
building anything, and so does the constructor of whichever comes second when a user applies them
by hand -- never a silently wrong result. Where a pair has one order (``Rule.first``) it is the
order ``minidist.parallel.parallelize`` applies: model transforms, the pipeline cut, checkpointing,
mixed precision, data parallelism, the optimizer.

How a technique is recognised on a model (``techniques_of``), so the check needs no bookkeeping
that could go stale: DDP and ZeRO record themselves (``claim``) on the module they wrap;
checkpointing, ZeRO-3, autocast and FP8 (``fp8_linear``'s "autocast" wrappers, owner ``FP8_OWNER``)
are read off ``Module``'s forward-wrapper stack; tensor and sequence parallelism off the layers (a
``comm`` and a ``sequence_parallel`` flag), context parallelism off its ring attention (a ``cp``
group and a ``layout``), experts off an MoE (a ``router`` and ``experts``); bf16 / fp16 off the
parameters' dtype; a pipeline stage is a ``PipelineStage``. Host offload is an optimizer
(``OffloadedAdamW(where="host")``): built last, on whatever parameters the others leave, it
combines with everything.

``python -m minidist.parallel.compose`` prints the matrix as the README shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

#: technique id -> the name errors and the README use
TECHNIQUES = {
    "ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "tp": "TP",
    "sp": "sequence parallel", "cp": "context parallel", "ep": "experts (MoE)",
    "pp": "PP 1F1B", "ckpt-full": "checkpointing (full)",
    "ckpt-selective": "checkpointing (selective)", "bf16": "bf16 mixed precision",
    "fp16": "fp16 mixed precision", "fp8": "FP8 training", "offload": "host offload",
}
ZERO = ("zero1", "zero2", "zero3")
FP8_OWNER = "fp8_linear"  # the owner of fp8_linear's forward wrappers: how FP8 is recognised
#: techniques that are a kind of model or optimizer rather than something applied to one
_MODEL = ("TP and sequence parallelism are the model itself (TPGPT): built first, then the other technique "
          "is applied to it")
_TRANSFORM = ("context parallelism and experts are model transforms (context_parallel, moe_gpt): built "
              "first, then the other technique is applied to the model")
BUILT_IN = {"tp": _MODEL, "sp": _MODEL, "ep": _TRANSFORM, "cp": _TRANSFORM,  # the order they are built in
            "offload": "host offload is the optimizer (OffloadedAdamW(where='host')): built last, on the "
                       "parameters the other technique leaves (ZeRO: its optimizer factory)"}


@dataclass(frozen=True)
class Rule:
    """One pair's verdict. ``first``: the technique that must be applied first (None: either order);
    ``reason``: why it is refused, or why only one order exists."""

    supported: bool
    reason: str = ""
    first: str | None = None


def _rules() -> dict:
    rules = {}

    def put(a, b, rule):
        rules[frozenset((a, b))] = rule

    for z in ZERO:
        put("ddp", z, Rule(False, "ZeRO is data parallelism itself: it averages (and shards) the gradients "
                                  "over the same ranks DDP would; wrap the model in one of them"))
        for dtype in ("bf16", "fp16"):
            put(z, dtype, Rule(False, "ZeRO shards and steps the model's own parameters with its optimizer, "
                                      "while MixedPrecision steps fp32 master copies with another; sharded "
                                      "fp32 masters are not built"))
        put(z, "pp", Rule(False, "a PipelineStage is not a Module (ZeRO-3 gathers a Module's layers as "
                                 "units) and run_schedule drives only DDP through the microbatches; ZeRO "
                                 "over a pipeline's data-parallel group is not built: use DDP"))
    for a, b in combinations(ZERO, 2):
        put(a, b, Rule(False, "one ZeRO stage per model: each owns the gradient sync and the optimizer step"))
    put("ckpt-full", "ckpt-selective", Rule(False, "one checkpointing policy per block: both wrap the "
                                                   "same blocks at the 'checkpoint' position; "
                                                   "remove_checkpointing first, or choose one"))
    put("bf16", "fp16", Rule(False, "one compute dtype per model: autocast casts the parameters to one "
                                    "of them"))
    put("cp", "sp", Rule(False, "both split the sequence over ranks, and a ring over sequence-parallel "
                                "shards is not built (context_parallel refuses a sequence-parallel TPGPT)"))
    put("cp", "ckpt-selective", Rule(False, "checkpoint='selective' recomputes the serial attention core, "
                                          "but ring attention keeps no T x T matrix to save; use 'full' or "
                                          "no checkpointing"))
    put("ep", "sp", Rule(False, "under sequence parallelism each tp rank's MLP sees only its own tokens, "
                                "and an MoE's expert gradients are not summed over the tp group: not built; "
                                "use TP without sequence parallelism"))
    for z in ZERO:
        put("ep", z, Rule(False, "ZeRO averages (and shards) every gradient over the data-parallel group, "
                                 "but expert parameters differ across an ep group; use DDP, which ignores "
                                 "them (they are averaged over the ranks holding the same experts)"))
    _fp8_rules(put)
    put("tp", "sp", Rule(True, "sequence parallelism is a mode of TP: the pair is the sequence-parallel "
                               "model"))
    put("ddp", "pp", Rule(True, "PipelineStage first: DDP wraps the stage over its data-parallel group "
                                "(DDP(stage, dp), as parallelize); on the whole model it would sync "
                                "gradients the stage never makes", first="pp"))
    for dtype in ("bf16", "fp16"):
        put("ddp", dtype, Rule(True, "MixedPrecision first (parallelize's order): DDP then wraps the "
                                     "low-precision model and its buckets carry low-precision gradients; "
                                     "its start-up broadcast would reach that copy, not the fp32 masters, "
                                     "so build the same weights on every rank and pass broadcast_from=None",
                                     first=dtype))
        put("pp", dtype, Rule(True, "PipelineStage first (parallelize's order): MixedPrecision then casts "
                                    "the stage's layers only and keeps their fp32 masters; the last stage's "
                                    "loss is of fp32 logits times mp.scale", first="pp"))
    for t, why in BUILT_IN.items():
        for other in TECHNIQUES:
            key = frozenset((t, other))
            if other != t and key not in rules:
                rules[key] = Rule(True, why, first=other if t == "offload" else t)
    return rules


def _fp8_rules(put) -> None:
    """FP8 training (``fp8_linear``): a wrapper on every Linear, applied after the model transforms and
    before the pipeline cut. Equal to the serial FP8 twin under block scaling, whose tiles are row-local
    (1 x block of a token's activation or gradient) and whose weight tiles every rank has whole; TP,
    sequence parallel, cp, experts and offload need no rule (``BUILT_IN``): test_compose trains each
    with FP8 to its serial FP8 twin."""
    for dtype in ("bf16", "fp16"):
        put("fp8", dtype, Rule(False, "one compute format per Linear: autocast casts the weights to 2 bytes, "
                                      "FP8 rounds the fp32 ones; use one of them"))
    for z in ZERO:
        put("fp8", z, Rule(False, "ZeRO with FP8 Linears is not built (nor tested against the serial "
                                  "FP8 twin); use DDP"))
    for c in ("ckpt-full", "ckpt-selective"):
        put("fp8", c, Rule(False, "a recomputed forward would record the delayed-scaling amaxes twice; "
                                  "use FP8 without activation checkpointing"))
    put("fp8", "ddp", Rule(True, "fp8_linear first (parallelize's order), then DDP wraps the FP8 model; "
                                 "block scaling's tiles are row-local, so each replica quantizes its rows as "
                                 "the serial run does (per-tensor recipes use one replica's amax)",
                           first="fp8"))
    put("fp8", "pp", Rule(True, "fp8_linear first, on the Module (a PipelineStage is not one), then the cut; "
                                "block scaling's tiles are row-local, so each microbatch quantizes its rows "
                                "as the whole batch would (per-tensor recipes use one microbatch's amax)",
                          first="fp8"))


RULES = _rules()


def rule(a: str, b: str) -> Rule:
    """The verdict for techniques ``a`` and ``b`` (supported, either order, unless the table says)."""
    for t in (a, b):
        if t not in TECHNIQUES:
            raise ValueError(f"unknown technique {t!r}; known: {', '.join(TECHNIQUES)}")
    return RULES.get(frozenset((a, b)), Rule(True))


def pairs() -> list[tuple[str, str]]:
    """Every unordered pair of distinct techniques, in the table's order."""
    return list(combinations(TECHNIQUES, 2))


# -- recognising what is applied -------------------------------------------------------------------

def claim(obj, technique: str, comm=None) -> None:
    """Record that ``technique`` (over ``comm``) now wraps ``obj`` (a Module or a PipelineStage)."""
    claims = obj.__dict__.setdefault("_techniques", {})
    claims[technique] = comm


def claimed(obj) -> dict:
    """technique -> communicator, of what recorded itself on ``obj``."""
    return dict(getattr(obj, "__dict__", {}).get("_techniques", {}))


def _modules(obj):
    if hasattr(obj, "named_modules"):
        return [m for _, m in obj.named_modules()]
    chunks = getattr(obj, "chunks", None)  # a PipelineStage: its layers
    return [m for chunk in chunks or () for layer in chunk for _, m in layer.named_modules()]


def techniques_of(obj) -> set[str]:
    """The techniques applied to ``obj`` (see the module docstring for how each is recognised)."""
    found = set(claimed(obj))
    if hasattr(obj, "chunks") and hasattr(obj, "num_stages"):
        found.add("pp")
    for m in _modules(obj):
        for handle in m.forward_wrappers():
            if handle.position == "checkpoint":
                found.add("ckpt-selective" if "selective" in handle.owner else "ckpt-full")
            elif handle.position == "zero3":
                found.add("zero3")
            elif handle.position == "autocast" and handle.owner == FP8_OWNER:
                found.add("fp8")
        if hasattr(m, "cp") and hasattr(m, "layout"):  # a ring attention or its embedding
            found.add("cp")
        if hasattr(m, "router") and hasattr(m, "experts"):  # a mixture of experts
            found.add("ep")
        if getattr(m, "comm", None) is not None and hasattr(m, "sequence_parallel") and m.comm.size > 1:
            found.add("sp" if m.sequence_parallel else "tp")
        for p in m._params.values():
            name = getattr(p.dtype, "name", str(p.dtype))
            if name in ("bfloat16", "float16"):
                found.add("bf16" if name == "bfloat16" else "fp16")
    if "sp" in found:
        found.add("tp")
    return found


def check_pairs(chosen) -> None:
    """Raise ``ValueError`` naming both and the reason if any two of ``chosen`` are refused
    (``parallelize`` calls it on what it is asked for, before building anything)."""
    for a, b in combinations(chosen, 2):
        r = rule(a, b)
        if not r.supported:
            raise ValueError(f"{TECHNIQUES[a]} cannot be combined with {TECHNIQUES[b]}: {r.reason}")


def check_compatible(obj, technique: str) -> None:
    """Raise ``ValueError`` if ``technique`` may not be applied to ``obj`` now: refused with a
    technique already there, or applied in the wrong order. Call it before doing anything."""
    if technique not in TECHNIQUES:
        return  # fp32, "none": not techniques of the matrix
    for present in sorted(techniques_of(obj) - {technique}):
        r = rule(technique, present)
        if not r.supported:
            raise ValueError(f"{TECHNIQUES[technique]} cannot be combined with {TECHNIQUES[present]} "
                             f"(already applied): {r.reason}")
        if r.first == technique:
            raise ValueError(f"{TECHNIQUES[technique]} must be applied before {TECHNIQUES[present]}, "
                             f"not after: {r.reason}")


# -- the README's matrix -----------------------------------------------------------------------------

def matrix_markdown() -> str:
    """The composition matrix as markdown: a grid (✓ either order, ✓n one order or a remark, ✗n
    refused) and the numbered notes, each reason written once."""
    ids = list(TECHNIQUES)
    notes: dict[str, int] = {}
    short = {t: TECHNIQUES[t].replace(" mixed precision", "").replace("checkpointing", "ckpt") for t in ids}
    lines = ["| | " + " | ".join(short[t] for t in ids) + " |", "|---" * (len(ids) + 1) + "|"]
    for a in ids:
        cells = []
        for b in ids:
            if a == b:
                cells.append("·")
                continue
            r = rule(a, b)
            mark = "✓" if r.supported else "✗"
            if r.reason:
                mark += f" {notes.setdefault(r.reason, len(notes) + 1)}"
            cells.append(mark)
        lines.append(f"| **{short[a]}** | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{n}. {text}" for text, n in notes.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(matrix_markdown())
