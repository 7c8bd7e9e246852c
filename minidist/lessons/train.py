"""Lesson 1: train a small GPT on one process, then let it write.

    python -m minidist.lessons.train                          # the text that ships with minidist
    python -m minidist.lessons.train --prompt "The ring "     # continue your own prompt
    python -m minidist.lessons.train --text FILE              # any UTF-8 text file
    python -m minidist.lessons.train --task reverse           # a synthetic task (copy/reverse/sort/addition)
    python -m minidist.lessons.train --save ckpt --plot loss.png
    python -m minidist.lessons.train --load ckpt --steps 300  # train the saved model further ...
    python -m minidist.lessons.train --load ckpt --steps 0    # ... or only sample from it
    python -m minidist.lessons.train --backend jax            # the same loop on JAX

Everything here is the serial twin that every later lesson splits across ranks: one model,
one optimizer, one loop of forward, backward, step. ``--save`` writes the whole training state
(parameters, AdamW moments, schedule, loader position, RNG streams) in the checkpoint format of
the fault-tolerance lesson (``minidist.resilience.checkpoint``), so ``--load`` continues exactly
where the saved run stopped: 2 steps, saved, then 2 more are the same bits as 4 steps.
The flags are parsed and checked, before any work, in ``minidist.lessons.train_cli``.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
from threadpoolctl import threadpool_limits

from minidist.accel.backend import bucket, compiles_per_shape, set_default_backend
from minidist.autograd.tensor import no_grad
from minidist.comm import world
from minidist.comm.transports.devices import describe_binding
from minidist.lessons.progress import progress
from minidist.lessons.train_cli import RUN_FLAGS, check_room, prepare, save_or_rescue
from minidist.nn import GPT, GPTConfig, optim
from minidist.nn.data import BatchLoader, ByteTokenizer
from minidist.plan import estimates
from minidist.resilience import checkpoint


def optimizer_for(model, lr, warmup=20):
    """AdamW and its schedule: a linear warmup over ``warmup`` steps, then the constant ``lr``.

    Constant, not decaying to the end of a run: a run has no end here (``--load`` trains further),
    and a schedule that does not depend on the step count makes 2 steps + 2 more the same as 4."""
    opt = optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return opt, optim.WarmupCosine(opt, warmup=warmup, total=max(warmup, 1), min_ratio=1.0)


def train(model, loader, steps, lr=None, warmup=20, clip=1.0, log=True, opt=None, schedule=None):
    """The training loop: per step a batch, forward, backward, gradient clipping, AdamW, the schedule.

    Without ``opt`` it makes AdamW with a warmup + cosine decay over ``steps`` (a run of known
    length); the lesson passes its own (``optimizer_for``). ``log``: a progress bar with the running
    loss (tqdm, drawn only on a terminal). Returns the list of losses."""
    if opt is None:
        opt = optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        schedule = optim.WarmupCosine(opt, warmup=warmup, total=steps)
    params = model.parameters()
    losses = []
    with progress(total=steps, desc="train", rank=0 if log else -1) as bar:  # rank != 0: no bar
        for _ in range(steps):
            x, y = loader.next_batch()
            loss = model.loss(x, y)
            loss.backward()
            if clip is not None:
                optim.clip_grad_norm(params, clip)
            opt.step()
            if schedule is not None:
                schedule.step()
            opt.zero_grad()
            losses.append(float(loss.item()))
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}", refresh=False)
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


def prompts_from(text: str, count: int = 3, seed: int = 0, words: int = 3) -> list[str]:
    """``count`` prompts drawn from the training text itself: the first ``words`` words of lines
    picked at random (seeded; lines that start with ``words`` plain words, where there are any),
    each ending in a space for the model to continue. A text without lines starting with a letter
    gives words after random spaces; one without spaces, its first line."""
    def words_at(i):
        return text[i:i + 200].split("\n")[0].split()[:words]

    lines = [i for i in range(len(text)) if (i == 0 or text[i - 1] == "\n") and text[i].isalpha()]
    starts = [i for i in lines if len(words_at(i)) == words  # lines of prose first, not of code or tables
              and all(w.strip(",.;:!?'\"()").isalpha() for w in words_at(i))] or lines
    if not starts:
        starts = [i + 1 for i, c in enumerate(text[:-1]) if c == " "] or [0]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(starts), size=count, replace=len(starts) < count)
    prompts = []
    for i in picks:
        head = words_at(starts[i])
        prompts.append(" ".join(head) + " " if head else text[:16])
    return prompts


# -- the lesson ---------------------------------------------------------------------------------------

class History:
    """The losses of every step so far, saved with the checkpoint so a resumed run's plot is whole."""

    def __init__(self):
        self.losses: list[float] = []

    def state_dict(self) -> dict:
        return {"losses": self.losses}

    def load_state_dict(self, sd: dict) -> None:
        self.losses = [float(v) for v in sd["losses"]]


def plot_losses(path, losses, uniform, title) -> None:
    """The loss curve: every step's loss, its 20-step running mean, and the uniform guess."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, color="tab:blue", alpha=0.35, lw=0.8, label="loss of each step's batch")
    k = min(20, len(losses))
    smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
    ax.plot(steps[k - 1:], smooth, color="tab:blue", lw=2, label=f"mean of the last {k} steps")
    ax.axhline(uniform, color="gray", ls="--", lw=1, label=f"uniform guess ln(vocab) = {uniform:.3f}")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    args, data = prepare(argv, __doc__)
    if args.backend is not None:
        set_default_backend(args.backend)
    try:
        with threadpool_limits(1):  # small matrices: one BLAS thread is faster than several (chapter 1)
            return lesson(args, data)
    finally:
        if args.backend is not None:  # called in-process (a test, a notebook): the caller's default again
            set_default_backend(None)


def lesson(args, data):
    """Build (or load), train, report, sample; returns this run's losses."""
    vocab, block = (data.vocab_size, data.block_size) if args.task else (ByteTokenizer.vocab_size, args.block)
    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model, seed=args.seed)
    model = GPT(cfg)
    be = next(iter(model.parameters())).backend
    print(describe_binding(be, 1, "one process"))
    if be.name == "jax":
        print("JAX compiles each new program once: a first run, or the first after minidist changed, is "
              "slower than later ones, which load the programs from minidist's cache (chapter 1 measures it)")
    loader = BatchLoader(data, args.batch, seed=args.seed)
    opt, sched = optimizer_for(model, args.lr)
    history = History()
    run = {"task": args.task, "text": args.text and os.path.abspath(args.text),
           **{f: getattr(args, f) for f in RUN_FLAGS}}
    objects = {"loader": loader, "schedule": sched, "history": history}
    state = checkpoint.TrainState(model, opt, objects=objects,
                                  config={"model": dataclasses.asdict(cfg), "run": run})
    comm, start = world(), 0
    if args.load:
        start = checkpoint.load(comm, args.load, state, required=True).step
        print(f"loaded step {start} from {args.load}: loss {np.mean(history.losses[-10:]):.3f} over its "
              f"last {min(10, len(history.losses))} steps")
    if args.save:
        check_room(comm, args.save, state, args.steps)  # before training: the run is never lost
    print(f"GPT: {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, context {block}, "
          f"{model.num_parameters():,} parameters; {len(data)} training windows")
    t0 = time.perf_counter()
    losses = train(model, loader, args.steps, opt=opt, schedule=sched)
    elapsed = time.perf_counter() - t0
    history.losses += losses
    if losses:
        report(args, cfg, model, losses, elapsed, start, vocab)
    if args.save:
        path = save_or_rescue(comm, args.save, start + args.steps, state)
        print(f"saved step {start + args.steps} to {path} (continue: --load {args.save})")
    if args.plot:
        plot_losses(args.plot, history.losses, np.log(vocab),
                    f"lesson 1: {model.num_parameters():,}-parameter GPT, "
                    f"batch {args.batch} x {block} tokens")
        print(f"wrote {args.plot}: the loss of {len(history.losses)} steps")
    show(args, model, data)
    return losses


def report(args, cfg, model, losses, elapsed, start, vocab) -> None:
    """The loss before and after, and the step time beside chapter 0's cost model and the planner's."""
    print(f"trained steps {start + 1}-{start + len(losses)} in {elapsed:.1f}s "
          f"({1e3 * elapsed / len(losses):.0f} ms/step): "
          f"loss {np.mean(losses[:5]):.3f} -> {np.mean(losses[-10:]):.3f} "
          f"(uniform guess: {np.log(vocab):.3f})")
    tokens = args.batch * cfg.block_size
    print(f"cost model (chapter 0): 6·N·D = 6 x {model.num_parameters():,} x {tokens:,} tokens = "
          f"{estimates.training_flops(model.num_parameters(), tokens) / 1e9:.2f} GFLOP per step")
    print(estimates.predicted_vs_measured(
        "one step on this machine's calibrated constants (the planner, chapter 11)",
        estimates.step_prediction(cfg.n_layer, cfg.d_model, cfg.n_head, vocab, cfg.block_size, args.batch),
        elapsed / len(losses)))


def show(args, model, data) -> None:
    """What the model learned: a task's answer accuracy, or text continuing each prompt."""
    model.eval()
    if args.task:
        x, y = data.get(np.arange(8))
        with no_grad():
            pred = model(x).numpy().argmax(-1)
        mask = y != -1
        print(f"{args.task}: answer-token accuracy on 8 examples {np.mean(pred[mask] == y[mask]):.2%}")
        return
    tok = ByteTokenizer()
    prompts = [args.prompt] if args.prompt is not None else prompts_from(args.text_content, seed=args.seed)
    for i, prompt in enumerate(prompts):
        out = sample(model, tok.encode(prompt), 80, seed=args.seed + i)
        print(f"  > {tok.decode(out)!r}")


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
