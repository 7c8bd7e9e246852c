"""Lesson 1's command line, checked before any work: a bad flag exits with status 2 and one line.

``prepare(argv)`` parses the flags and returns ``(args, data)``: the training windows loaded, the
``--load`` checkpoint's model and run taken over (a size flag that disagrees with it is refused),
``--save``'s folder checked by the save's own rule, ``--backend`` imported. Once the model is built,
``check_room`` checks the save will fit, and ``save_or_rescue`` never loses a trained run. The lesson
itself is ``minidist.lessons.train``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from minidist.accel.backend import BACKENDS, get_backend
from minidist.comm import world
from minidist.lessons.cli import LessonParser, nonnegative_int, positive_float, positive_int
from minidist.nn.data import ByteTokenizer, SyntheticTask, TextDataset, default_text
from minidist.resilience import checkpoint
from minidist.resilience.checkpoint import files as ckpt_files
from minidist.resilience.checkpoint import folder as ckpt_folder
from minidist.resilience.checkpoint.writer import plan_file, snapshot

# the model and the run a bare `python -m minidist.lessons.train` trains (chapter 1 has the numbers)
DEFAULTS = {"layers": 2, "d_model": 128, "heads": 4, "block": 64, "batch": 16, "lr": 3e-3}
# the flags a --load checkpoint decides: the model's (GPTConfig field) and the run's (saved as they are)
MODEL_FLAGS = {"layers": "n_layer", "d_model": "d_model", "heads": "n_head", "block": "block_size"}
RUN_FLAGS = ("batch", "lr")



# -- flags: every one checked before any work --------------------------------------------------------

def steps_flag(text: str) -> int:
    """``--steps``: an integer >= 1, or 0 (with ``--load``: sample from the saved model only)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (or 0 with --load: sample only), "
                                         f"got {text!r}")
    return value


def parser(doc: str = "") -> LessonParser:
    """The flags; ``doc`` (the lesson's docstring) gives the help text."""
    lines = doc.splitlines() or [None]
    ap = LessonParser(description=lines[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog="\n".join(lines[2:11]))
    ap.add_argument("--text", help="a UTF-8 text file (default: the text shipped with minidist)")
    ap.add_argument("--task", choices=SyntheticTask.KINDS, help="train on a synthetic task instead")
    ap.add_argument("--steps", type=steps_flag, default=600, help="training steps of this run (default 600)")
    for flag, default in DEFAULTS.items():  # None: the default, or the --load checkpoint's
        note = ", a multiple of --heads" if flag == "d_model" else ""
        ap.add_argument("--" + flag.replace("_", "-"), type=positive_float if flag == "lr" else positive_int,
                        default=None, help=f"default {default}{note}")
    ap.add_argument("--seed", type=nonnegative_int, default=0)
    ap.add_argument("--prompt", help="sample continuing this text (default: 3 prompts drawn from the "
                                     "training text)")
    ap.add_argument("--save", metavar="DIR", help="save the training state at the end (a checkpoint folder)")
    ap.add_argument("--load", metavar="DIR", help="start from the newest checkpoint in DIR (its model "
                                                  "and run: --steps more steps, or 0 to only sample)")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the loss curve")
    ap.add_argument("--backend", choices=BACKENDS, default=None,
                    help="array library (default $MINIDIST_BACKEND or numpy)")
    return ap


def load_data(args):
    """The training windows the flags ask for, or a ValueError naming the flag: a ``--text`` that is
    missing, a folder, not UTF-8, or shorter than one ``--block`` window (TextDataset's own rule)."""
    if args.task:
        return SyntheticTask(args.task, length=6, size=2048, seed=args.seed)
    if args.text is not None:
        if os.path.isdir(args.text):
            raise ValueError(f"argument --text: {args.text!r} is a folder; give a UTF-8 text file")
        if not os.path.isfile(args.text):
            raise ValueError(f"argument --text: no such file: {args.text!r}")
    try:
        text = default_text() if args.text is None else open(args.text, encoding="utf-8").read()
    except UnicodeDecodeError as e:
        raise ValueError(f"argument --text: {args.text!r} is not UTF-8 text (byte {e.start}: {e.reason}); "
                         "give a text file") from None
    args.text_content = text
    tokens = ByteTokenizer().encode(text)
    try:
        return TextDataset(tokens, block_size=args.block)
    except ValueError as e:
        fix = f"use --block <= {len(tokens) - 1}" if len(tokens) > 1 else "give a longer --text"
        raise ValueError(f"argument --block: {args.block}: {e}; {fix}") from None


def saved_config(root) -> dict:
    """The model configuration of the newest intact checkpoint in ``root`` (ValueError naming
    ``--load`` if there is none): ``--load`` builds that model, whatever the size flags say."""
    if not os.path.isdir(root):
        raise ValueError(f"argument --load: no such folder: {root!r}; give a folder an earlier --save wrote")
    where, manifest, problems = ckpt_files.choose(world(), root, job=os.environ.get("MINIDIST_JOB_ID"),
                                                  any_job=False)
    if where is None:
        why = f" ({'; '.join(problems)})" if problems else ""
        raise ValueError(f"argument --load: no intact checkpoint in {root!r}{why}; give a folder an earlier "
                         f"--save wrote")
    if not isinstance(manifest.get("config"), dict) or "model" not in manifest["config"]:
        raise ValueError(f"argument --load: {root!r} holds a checkpoint of another program (no lesson-1 "
                         f"model configuration in it); give a folder `--save` of this lesson wrote")
    return manifest["config"]


def check_save(root) -> None:
    """``--save DIR``: a new folder inside an existing one, or one the save may write -- the save's own
    rule (``folder.check``: minidist's folder of this job or an empty one, no link, nobody else's)."""
    parent = os.path.dirname(os.path.abspath(root))
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"argument --save: {root!r} is a file; give a folder for the checkpoints")
    if not os.path.lexists(root) and not os.path.isdir(parent):
        raise ValueError(f"argument --save: folder {parent} of {root!r} does not exist")
    try:
        ckpt_folder.check(root, os.environ.get("MINIDIST_JOB_ID"))  # the job TrainState saves as
    except checkpoint.CheckpointError as e:
        raise ValueError(f"argument --save: {e}") from None


def check_room(comm, root, state, steps: int) -> None:
    """(Before training) exit 2 with one line if ``--save``'s file system has no room for the
    checkpoint: its file's exact size (the save reserves it; AdamW's m and v, made at the first step,
    counted), and the manifest with ``steps`` more losses recorded."""
    opt = state.optimizer
    moments = 2 * sum(p.data.nbytes for p, st in zip(opt.params, opt.state) if not st)
    need = plan_file(snapshot(comm, 0, state), 0)[2] + moments + 2 * ((64 << 10) + 32 * steps)
    where = os.path.abspath(root)
    while not os.path.isdir(where):
        where = os.path.dirname(where)
    free = ckpt_folder.free_bytes(where)
    if 0 <= free < need:
        sys.stderr.write(f"python -m minidist.lessons.train: error: argument --save: {root!r} has no room "
                         f"for the checkpoint: it needs {need:,} bytes, {free:,} are free at {where}\n")
        sys.exit(2)


def save_or_rescue(comm, root, step: int, state) -> str:
    """``checkpoint.save``; if it fails after all (the disk filled during training), the trained state
    goes to a new temporary folder and the error says where: a trained run is never lost."""
    try:
        return checkpoint.save(comm, root, step, state)
    except checkpoint.CheckpointError as e:
        rescue = tempfile.mkdtemp(prefix="minidist-train-rescue-")
        checkpoint.save(comm, rescue, step, state)
        raise SystemExit(f"python -m minidist.lessons.train: --save {root} failed: {e}\nthe trained "
                         f"state (step {step}) is saved in {rescue} instead: continue with --load {rescue}"
                         ) from None


def prepare(argv=None, doc: str = ""):
    """Parse and check every flag before any training: (args, data), or exit status 2 and one line.
    ``doc``: the lesson's docstring, for ``--help``."""
    ap = parser(doc)
    args = ap.parse_args(argv)
    try:
        if args.backend is not None:
            try:
                get_backend(args.backend)
            except RuntimeError as e:
                raise ValueError(f"argument --backend: {e}") from None
        args.saved = saved_config(args.load) if args.load else None
        if args.saved is not None:
            resolve_from_checkpoint(args)
        small = args.batch is None  # the default batch: at most the text's windows (a short --text)
        for flag, default in DEFAULTS.items():
            if getattr(args, flag) is None:
                setattr(args, flag, default)
        if args.steps == 0 and not args.load:
            raise ValueError("argument --steps: must be an integer >= 1 (0 only with --load DIR: sample "
                             "from the saved model)")
        if args.d_model % args.heads:
            raise ValueError(f"argument --d-model: must be a multiple of --heads {args.heads}, "
                             f"got {args.d_model}")
        if args.prompt is not None and args.task:
            raise ValueError(f"argument --prompt: --task {args.task} is scored by its answers, not sampled; "
                             "drop --prompt or --task")
        if args.prompt is not None and not args.prompt:
            raise ValueError("argument --prompt: give at least one character to continue")
        if args.save:
            check_save(args.save)
        data = load_data(args)
        if small:
            args.batch = min(args.batch, len(data))
        if args.batch > len(data):
            raise ValueError(f"argument --batch: {args.batch} is more than the {len(data)} training windows; "
                             f"use --batch <= {len(data)}")
    except ValueError as e:
        ap.error(str(e))
    return args, data


def resolve_from_checkpoint(args) -> None:
    """Take the model, the batch, the learning rate and the data (``--task``) from the ``--load``
    checkpoint; one of those flags given with another value is a ValueError naming both."""
    model, run = args.saved["model"], args.saved.get("run", {})
    for flag in DEFAULTS:
        given, saved = getattr(args, flag), model[MODEL_FLAGS[flag]] if flag in MODEL_FLAGS else run.get(flag)
        if flag == "block" and run.get("task"):
            saved = None  # a task's context is the task's own
        if given is not None and saved is not None and given != saved:
            raise ValueError(f"argument --{flag.replace('_', '-')}: {given}, but the checkpoint in "
                             f"{args.load!r} "
                             f"has {saved}; drop the flag (--load continues the saved run)")
        setattr(args, flag, saved if saved is not None else DEFAULTS[flag])
    if args.task is None and args.text is None:
        args.task, args.text = run.get("task"), run.get("text")
        if args.text is not None and not os.path.isfile(args.text):
            raise ValueError(f"argument --load: {args.load!r} was trained on {args.text!r}, which is "
                             "no longer there; pass --text FILE")
    if (args.task or None) != (run.get("task") or None):
        raise ValueError(f"argument --task: {args.task}, but the checkpoint in {args.load!r} was trained on "
                         f"{run.get('task') or 'text'}; use the same data")
