"""Lesson 1: train a small GPT on one process, then let it write.

    python -m minidist.lessons.train                 # the text that ships with minidist
    python -m minidist.lessons.train --text FILE     # any UTF-8 text file
    python -m minidist.lessons.train --task reverse  # a synthetic task (copy/reverse/sort/addition)

Everything here is the serial twin that every later lesson splits across ranks: one model,
one optimizer, one loop of forward, backward, step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from minidist.accel.backend import bucket, compiles_per_shape, default_backend
from minidist.autograd.tensor import no_grad
from minidist.comm.transports.devices import describe_binding
from minidist.lessons.cli import nonnegative_int, positive_float, positive_int
from minidist.nn import GPT, GPTConfig, optim
from minidist.nn.data import BatchLoader, ByteTokenizer, SyntheticTask, TextDataset, default_text
from minidist.plan import estimates
from minidist.testing import train_steps


def progress(step, total, loss, t0, width=30):
    """One line, redrawn in place: [#####.....] step/total loss, steps/s."""
    done = int(width * step / total)
    rate = step / max(time.perf_counter() - t0, 1e-9)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.3f} "
                     f"({rate:.1f} steps/s)")
    sys.stdout.flush()


def train(model, loader, steps, lr, warmup=20, clip=1.0, log=True):
    """The training loop (``minidist.testing.train_steps``, with a warmup + cosine schedule and
    gradient clipping), drawing a progress bar; returns the list of losses."""
    opt = optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = optim.WarmupCosine(opt, warmup=warmup, total=steps)
    t0 = time.perf_counter()

    def show(i, losses):
        step = i + 1
        if log and (step % 5 == 0 or step == steps):
            progress(step, steps, float(np.mean(losses[-5:])), t0)
    batches = (loader.next_batch() for _ in range(steps))
    losses = train_steps(model, batches, opt, clip=clip, schedule=sched, on_step=show)
    if log:
        print()
    return losses


def sample(model, prompt_ids, new_tokens, temperature=0.8, seed=0):
    """Sample by recomputing the whole window each step (the KV-cached way is in minidist.infer).

    On JAX the window is padded to the next power of two (a new length would be a new compiled
    program every token); causal attention keeps the padding from changing the real positions."""
    rng = np.random.default_rng(seed)
    ids = list(prompt_ids)
    block = model.config.block_size
    padded = compiles_per_shape(next(iter(model.parameters())).backend)
    with no_grad():
        for _ in range(new_tokens):
            window = ids[-block:]
            pad = [0] * (bucket(len(window), block) - len(window) if padded else 0)
            logits = model(np.array([window + pad])).numpy()[0, len(window) - 1].astype(np.float64)
            p = np.exp((logits - logits.max()) / temperature)
            ids.append(int(rng.choice(len(p), p=p / p.sum())))
    return ids


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", help="a UTF-8 text file (default: the text shipped with minidist)")
    ap.add_argument("--task", choices=SyntheticTask.KINDS, help="train on a synthetic task instead")
    ap.add_argument("--steps", type=positive_int, default=400)
    ap.add_argument("--batch", type=positive_int, default=32)
    ap.add_argument("--block", type=positive_int, default=64)
    ap.add_argument("--layers", type=positive_int, default=2)
    ap.add_argument("--d-model", type=positive_int, default=128, help="a multiple of --heads")
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--lr", type=positive_float, default=3e-3)
    ap.add_argument("--seed", type=nonnegative_int, default=0)
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
    tokens = ByteTokenizer().encode(text)
    try:
        return TextDataset(tokens, block_size=args.block)
    except ValueError as e:
        fix = f"use --block <= {len(tokens) - 1}" if len(tokens) > 1 else "give a longer --text"
        raise ValueError(f"argument --block: {args.block}: {e}; {fix}") from None


def prepare(argv=None):
    """Parse and check every flag before any training: (args, data), or exit status 2 and one line."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.d_model % args.heads:
        ap.error(f"argument --d-model: must be a multiple of --heads {args.heads}, got {args.d_model}")
    try:
        data = load_data(args)
    except ValueError as e:
        ap.error(str(e))
    return args, data


def main(argv=None):
    args, data = prepare(argv)
    if args.task:
        vocab, block = data.vocab_size, data.block_size
    else:
        vocab, block = ByteTokenizer.vocab_size, args.block
    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model, seed=args.seed)
    model = GPT(cfg)
    print(describe_binding(default_backend(), 1, "one process"))
    print(f"GPT: {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, context {block}, "
          f"{model.num_parameters():,} parameters; {len(data)} training windows")
    loader = BatchLoader(data, args.batch, seed=args.seed)
    t0 = time.perf_counter()
    losses = train(model, loader, args.steps, args.lr)
    elapsed = time.perf_counter() - t0
    print(f"trained {args.steps} steps in {elapsed:.1f}s: loss {np.mean(losses[:5]):.3f} "
          f"-> {np.mean(losses[-5:]):.3f} (uniform guess: {np.log(vocab):.3f})")
    tokens = args.batch * block
    print(f"cost model (chapter 0): 6·N·D = 6 x {model.num_parameters():,} x {tokens:,} tokens = "
          f"{estimates.training_flops(model.num_parameters(), tokens) / 1e9:.2f} GFLOP per step")
    print(estimates.predicted_vs_measured(
        "one step on this machine's calibrated constants (the planner, chapter 11)",
        estimates.step_prediction(cfg.n_layer, cfg.d_model, cfg.n_head, vocab, block, args.batch),
        elapsed / args.steps))

    model.eval()
    if args.task:
        x, y = data.get(np.arange(8))
        with no_grad():
            pred = model(x).numpy().argmax(-1)
        mask = y != -1
        print(f"{args.task}: answer-token accuracy on 8 examples {np.mean(pred[mask] == y[mask]):.2%}")
    else:
        tok = ByteTokenizer()
        for i, prompt in enumerate(["Data parallelism ", "The pipeline ", "A neural network "]):
            out = sample(model, tok.encode(prompt), 80, seed=args.seed + i)
            print(f"  > {tok.decode(out)!r}")
    return losses


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
