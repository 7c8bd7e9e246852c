"""Lesson 1's command line, checked before any work: a bad flag exits with status 2 and one line.

``prepare(argv)`` parses the flags and returns ``(args, data)``: the training windows loaded, the
``--load`` checkpoint's model and run taken over (a size flag that disagrees with it is refused),
``--save``'s folder checked, ``--backend`` imported. The lesson itself is ``minidist.lessons.train``.
"""

from __future__ import annotations

import argparse
import os

from minidist.accel.backend import BACKENDS, get_backend
from minidist.comm import world
from minidist.lessons.cli import LessonParser, nonnegative_int, positive_float, positive_int
from minidist.nn.data import ByteTokenizer, SyntheticTask, TextDataset, default_text
from minidist.resilience.checkpoint import files as ckpt_files
from minidist.resilience.checkpoint import folder as ckpt_folder

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
    """``--save DIR``: a new folder inside an existing one, or a checkpoint folder minidist made."""
    parent = os.path.dirname(os.path.abspath(root))
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"argument --save: {root!r} is a file; give a folder for the checkpoints")
    if not os.path.isdir(parent):
        raise ValueError(f"argument --save: folder {parent} of {root!r} does not exist")
    if os.path.isdir(root) and ckpt_folder.owner(root) is None:
        foreign = [e for e in os.listdir(root) if not e.startswith(("step-", "latest"))]
        if foreign:
            raise ValueError(f"argument --save: {root!r} holds files minidist did not write "
                             f"({', '.join(sorted(foreign)[:3])}); give a new or empty folder")
    if not os.access(root if os.path.isdir(root) else parent, os.W_OK):
        raise ValueError(f"argument --save: {root!r} is not writable")


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
