"""`python -m minidist.plan --model llama3-70b --chips 64 --batch 512 --hardware h100 [--plot FILE.png]`

Searches every candidate mesh and prints the best few, ranked, with why each loses to the first.
`--mesh dp=8,tp=8,pp=1,zero=1,checkpoint=full,microbatch_size=1` (repeatable) evaluates just those;
`microbatches=8` there is the lessons' count (microbatches per replica per step) instead of a size.
`--schedule zb_h1` (or zb_h2, zb_v, dualpipe, dualpipe_v, gpipe, ...) searches with that pipeline
schedule (`minidist.plan.schedules`: its bubble and memory formulas), or sets it for every --mesh.
"""

from __future__ import annotations

import argparse
import os

from minidist.parallel.pipeline.schedule import ScheduleError
from minidist.plan import hardware, schedules
from minidist.plan.mesh import Candidate, Settings
from minidist.plan.model import ModelSpec
from minidist.plan.presets import MODELS
from minidist.plan.report import human, links, plot, table  # noqa: F401 - re-exported (lessons.planning)
from minidist.plan.search import MAX_CHIPS, MAX_CHIPS_WHY, candidates, plan

CUSTOM = ("--layers", "--d-model", "--heads", "--vocab", "--seq")  # the shape of --model custom


def check(model: ModelSpec, cand: Candidate, batch: int) -> str:
    """What is wrong with running `model` on `cand` with this batch ("" if nothing), and what would do."""
    if model.n_head % cand.tp:
        return f"{model.n_head} heads do not split over tp={cand.tp}; use a tp that divides {model.n_head}"
    stages = cand.pp * cand.chunks
    most = model.n_layer + 2 if model.engine == "minidist" else model.n_layer
    if stages > most:
        return f"{stages} pipeline stages (pp x chunks) but only {most} layers to cut; use at most {most}"
    if batch % (cand.dp * cand.microbatch_size):
        return (f"batch {batch} does not split into dp={cand.dp} replicas x microbatches of "
                f"{cand.microbatch_size}; use a batch that is a multiple of {cand.dp * cand.microbatch_size}")
    m = cand.microbatches(batch)
    if m < 1:
        return (f"batch {batch} gives no microbatch of {cand.microbatch_size} per replica on dp={cand.dp}; "
                f"use a batch of at least {cand.dp * cand.microbatch_size}")
    if cand.schedule == "dualpipe" and cand.pp % 2:
        return f"DualPipe feeds microbatches from both ends and needs an even pp, got pp={cand.pp}"
    try:
        if cand.pp > 1:
            schedules.build(cand.schedule, cand.pp, m, cand.chunks)
    except ScheduleError as e:
        return f"{cand.schedule} with m = {m} microbatches on pp={cand.pp}: {e}"
    return ""


SCHEDULE_NAMES = tuple(schedules.SCHEDULES) + tuple(n.replace("_", "-") for n in schedules.SCHEDULES
                                                     if "_" in n)  # zb-h1 as the lesson spells it
MESH_CHOICES = {"checkpoint": ("none", "selective", "full"), "schedule": SCHEDULE_NAMES}
MESH_LOW = {"zero": 0}  # every other integer field is a size >= 1


def parse_mesh(text: str, chips: int, batch: int | None = None, schedule: str | None = None) -> Candidate:
    """"dp=8,tp=8,zero=1,checkpoint=full" -> Candidate (dp defaults to chips / (tp·pp·cp)); a bad field
    or value is a ValueError naming it and what is allowed. `microbatches=m` (the lessons' count, with
    `batch`) stands for microbatch_size = batch / (dp·m); `schedule` is the --schedule flag's (a
    field in the text wins); a V schedule runs two chunks per stage."""
    kw = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key == "microbatch":
            raise ValueError(f"--mesh {text!r}: say microbatch_size={value} (sequences in each microbatch) "
                             f"or microbatches=N (how many per replica per step, as the lessons' "
                             f"--microbatches)")
        if key == "microbatches" and batch is not None:
            key = "_count"
        elif key not in Candidate.__dataclass_fields__:
            fields = ", ".join(Candidate.__dataclass_fields__)
            raise ValueError(f"--mesh {text!r}: unknown field {key!r}; use {fields}")
        if key in MESH_CHOICES:
            if value not in MESH_CHOICES[key]:
                choices = ", ".join(MESH_CHOICES[key])
                raise ValueError(f"--mesh {text!r}: {key}={value!r}; use one of {choices}")
            kw[key] = value
            continue
        low = MESH_LOW.get(key, 1)
        try:
            kw[key] = int(value)
        except ValueError:
            raise ValueError(f"--mesh {text!r}: {key}={value!r} is not an integer; use {key}=N with "
                             f"N >= {low}") from None
        if kw[key] < low or (key == "zero" and kw[key] > 3):
            rule = "0, 1, 2 or 3 (a ZeRO stage)" if key == "zero" else f"an integer >= {low}"
            raise ValueError(f"--mesh {text!r}: {key}={kw[key]} must be {rule}")
    if "dp" not in kw:
        kw["dp"] = chips // (kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1))
        if kw["dp"] < 1:
            raise ValueError(f"--mesh {text!r} needs more than the {chips} chips of --chips")
    if "_count" in kw:
        count = kw.pop("_count")
        if batch % (kw["dp"] * count):
            raise ValueError(f"--mesh {text!r}: batch {batch} does not split into dp={kw['dp']} replicas x "
                             f"{count} microbatches; use a count that divides {batch // kw['dp']}")
        kw["microbatch_size"] = batch // (kw["dp"] * count)
    if schedule is not None and "schedule" not in kw:
        kw["schedule"] = schedule
    if "schedule" in kw:
        kw["schedule"] = schedules.canonical(kw["schedule"])
        fixed = schedules.get(kw["schedule"]).chunks
        if fixed and kw.setdefault("chunks", fixed) != fixed:
            raise ValueError(f"--mesh {text!r}: {kw['schedule']} runs {fixed} chunks per stage; "
                             f"drop chunks= or use chunks={fixed}")
    cand = Candidate(**kw)
    if cand.chips != chips:
        raise ValueError(f"--mesh {text!r} uses {cand.chips} chips, but --chips is {chips}")
    return cand


def _int_from(low: int, high: int | None = None, why: str = ""):
    """An argparse type: an integer in [low, high], else an error stating the range (and ``why``)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            top = f" and <= {high:,}{why}" if high is not None else ""
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}{top}, got {value}")
        return value
    return parse


def check_plot(path: str | None) -> str:
    """--plot's folder must exist and be writable: checked before the search, not after it."""
    if path:
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            return f"argument --plot: {path!r} is a folder; give a file name inside it"
        if not os.path.isdir(folder):
            return f"argument --plot: folder {folder} of {path!r} does not exist"
        if not os.access(folder, os.W_OK):
            return f"argument --plot: folder {folder} of {path!r} is not writable"
    return ""


def build_model(args) -> ModelSpec:
    """The ModelSpec the flags name: a preset with any shape flags over it, or ``custom`` with all of
    them (a ValueError names what is missing or inconsistent)."""
    if args.model == "custom":
        missing = [f for f in CUSTOM if getattr(args, f[2:].replace("-", "_")) is None]
        if missing:
            raise ValueError(f"argument --model custom: needs the model's shape; add {' '.join(missing)} "
                             "(e.g. --layers 32 --d-model 4096 --heads 32 --vocab 32000 --seq 4096)")
        model = ModelSpec("custom", n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                          vocab=args.vocab, seq=args.seq, engine=args.engine or "megatron",
                          dtype_bytes=4 if args.engine == "minidist" else 2)
    else:
        model = MODELS[args.model]
        changes = {k: v for k, v in dict(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                                         vocab=args.vocab, seq=args.seq).items() if v}
        model = model.replace(**changes) if changes else model
    return model


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minidist.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-70b", choices=(*MODELS, "custom"),
                    help="a preset, or 'custom' (with --layers, --d-model, --heads, ...)")
    for flag in CUSTOM:
        ap.add_argument(flag, type=_int_from(1), help="model shape (overrides the preset's)")
    ap.add_argument("--engine", choices=("megatron", "minidist"), default=None,
                    help="what a rank stores: Megatron-style bf16 + fp32 master (default), or minidist's GPT")
    ap.add_argument("--batch", type=_int_from(1), default=512, help="global batch in sequences")
    ap.add_argument("--chips", type=_int_from(1, MAX_CHIPS, f" ({MAX_CHIPS_WHY})"), default=64,
                    help=f"accelerators (ranks) in all, at most {MAX_CHIPS:,}")
    ap.add_argument("--hardware", default="h100", help=f"{', '.join(hardware.PRESETS)} or 'here'")
    ap.add_argument("--transport", choices=("threads", "mpi"), default="threads",
                    help="with --hardware here: the ranks as threads of one process, or mpirun processes")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--top", type=_int_from(1), default=8, help="how many ranked meshes to print")
    ap.add_argument("--plot", metavar="FILE.png", help="draw memory by kind and the step's time breakdown")
    ap.add_argument("--schedule", choices=SCHEDULE_NAMES, default=None,
                    help="pipeline schedule to search with (or for every --mesh); default: 1f1b and "
                         "interleaved")
    ap.add_argument("--mesh", action="append", default=[], metavar="dp=..,tp=..,pp=..,...",
                    help="evaluate this mesh (fields of minidist.plan.Candidate) instead of searching")
    args = ap.parse_args(argv)
    if check_plot(args.plot):
        ap.error(check_plot(args.plot))
    try:
        model = build_model(args)
    except ValueError as e:
        ap.error(str(e))
    try:
        here = args.hardware == "here"
        hw = hardware.here(transport=args.transport) if here else hardware.get(args.hardware)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    try:
        cands = [parse_mesh(s, args.chips, args.batch, args.schedule) for s in args.mesh] or None
    except ValueError as e:
        ap.error(str(e))
    for cand in cands or []:
        problem = check(model, cand, args.batch)
        if problem:
            ap.error(f"--mesh {cand.label()}: {problem}")
    if cands is None and args.schedule is not None:
        cands = candidates(model, args.chips, args.batch, hw, schedule_names=(args.schedule,))
        if not cands:
            ap.error(f"argument --schedule: {args.schedule} runs on no mesh of {args.chips} chips with batch "
                     f"{args.batch} (too few microbatches per replica, or pp odd for dualpipe); try 1f1b")
    preds = plan(model, args.chips, args.batch, hw, Settings(args.optimizer), top=args.top, cands=cands)
    print(f"{model.name}: {model.params() / 1e9:.3g}B parameters, batch {args.batch} x {model.seq} tokens, "
          f"{args.chips} x {hw.name} ({hw.hbm_bytes / 1e9:.0f} GB each)")
    for n in model.notes:
        print("  assumption:", n)
    print(table(preds, args.top, args.batch, hw))
    if args.plot:
        plot(preds, args.plot, args.top, hw.hbm_bytes)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
