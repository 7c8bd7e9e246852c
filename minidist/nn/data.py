"""Data: a byte-level tokenizer, a text-file dataset, synthetic tasks, a resumable batch loader, and
the split of data over data-parallel ranks (``DistributedSampler``, ``split_batch``).

A dataset is anything with ``len(ds)`` and ``ds.get(indices) -> (x, y)``: integer arrays of shape
(len(indices), T), ``y`` the next-token targets with -1 where no loss is taken (the prompt part
of a synthetic task). The loader draws a seeded permutation per epoch and remembers where it is,
so training can stop and resume on exactly the same batch.
"""

from __future__ import annotations

from importlib import resources

import numpy as np


class ByteTokenizer:
    """Text <-> UTF-8 bytes: vocabulary 256, no training, nothing unknown."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def default_text() -> str:
    """The text that ships with minidist: an essay on how large models are trained, followed by the
    course's chapters (lessons/*.md as they were when the package was built)."""
    return resources.files("minidist").joinpath("assets/corpus.txt").read_text(encoding="utf-8")


def _check_int(owner: str, name: str, value, low: int) -> None:
    """A clear TypeError/ValueError naming ``owner``'s argument unless ``value`` is an integer >= low."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{owner}: {name} must be an integer >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{owner}: {name} must be an integer >= {low}, got {value}")


class TextDataset:
    """Windows of ``block_size + 1`` tokens from one token stream, every ``stride`` tokens."""

    def __init__(self, tokens, block_size: int, stride: int | None = None):
        _check_int("TextDataset", "block_size", block_size, 1)
        if stride is not None:
            _check_int("TextDataset", "stride", stride, 1)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.block_size = block_size
        self.stride = stride or max(1, block_size // 2)
        if len(self.tokens) < block_size + 1:
            raise ValueError(f"TextDataset: text of {len(self.tokens)} tokens is shorter than one window "
                             f"(block_size + 1 tokens); block_size must be <= {len(self.tokens) - 1}, "
                             f"got {block_size}")
        self.starts = np.arange(0, len(self.tokens) - block_size, self.stride)

    @classmethod
    def from_file(cls, path=None, block_size: int = 64, tokenizer=None):
        tok = tokenizer or ByteTokenizer()
        text = default_text() if path is None else open(path, encoding="utf-8").read()
        return cls(tok.encode(text), block_size)

    def __len__(self):
        return len(self.starts)

    def get(self, indices):
        rows = self.starts[np.asarray(indices)][:, None] + np.arange(self.block_size + 1)
        chunk = self.tokens[rows]
        return chunk[:, :-1], chunk[:, 1:]


class SyntheticTask:
    """A task a small model learns quickly: ``copy``, ``reverse``, ``sort`` or ``addition``.

    Each example is prompt + SEP + answer; the loss is taken on the answer only. Tokens 0..9 are
    digits/symbols, 10 is SEP, 11 is '+'; vocabulary 12.
    """

    SEP, PLUS, vocab_size = 10, 11, 12
    KINDS = ("copy", "reverse", "sort", "addition")

    def __init__(self, kind: str, length: int = 8, size: int = 4096, seed: int = 0):
        if kind not in self.KINDS:
            raise ValueError(f"unknown task {kind!r}; known tasks: {', '.join(self.KINDS)}")
        _check_int("SyntheticTask", "length", length, 1)
        _check_int("SyntheticTask", "size", size, 1)
        self.kind, self.length, self.size = kind, length, size
        rng = np.random.default_rng(seed)
        if kind == "addition":
            a = rng.integers(0, 10, (size, length))
            b = rng.integers(0, 10, (size, length))
            answer = self._add_digits(a, b)
            prompt = np.concatenate([a, np.full((size, 1), self.PLUS), b], axis=1)
        else:
            prompt = rng.integers(0, 10, (size, length))
            answer = {"copy": prompt, "reverse": prompt[:, ::-1], "sort": np.sort(prompt, axis=1)}[kind]
        full = np.concatenate([prompt, np.full((size, 1), self.SEP), answer], axis=1)
        self.x = full[:, :-1]
        self.y = full[:, 1:].copy()
        self.y[:, : prompt.shape[1]] = -1  # no loss on the prompt
        self.block_size = self.x.shape[1]

    @staticmethod
    def _add_digits(a, b):
        """Digits little-endian (least significant first), so the answer is produced carry-first."""
        out = np.zeros((a.shape[0], a.shape[1] + 1), dtype=np.int64)
        carry = np.zeros(a.shape[0], dtype=np.int64)
        for i in range(a.shape[1]):
            s = a[:, i] + b[:, i] + carry
            out[:, i], carry = s % 10, s // 10
        out[:, -1] = carry
        return out

    def __len__(self):
        return self.size

    def get(self, indices):
        indices = np.asarray(indices)
        return self.x[indices], self.y[indices]


class BatchLoader:
    """Seeded, resumable batches: epoch e visits the dataset in ``default_rng([seed, e])`` order.

    ``state_dict()`` is (epoch, position); loading it resumes on exactly the next batch. A final
    incomplete batch of an epoch is dropped, so every batch has ``batch_size`` rows.
    """

    def __init__(self, dataset, batch_size: int, seed: int = 0, shuffle: bool = True):
        _check_int("BatchLoader", "batch_size", batch_size, 1)
        _check_int("BatchLoader", "seed", seed, 0)
        if batch_size > len(dataset):
            raise ValueError(f"batch_size must be in [1, {len(dataset)}] (the dataset size), "
                             f"got {batch_size}")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self):
        n = len(self.dataset)
        return np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)

    def next_batch(self):
        if self.position + self.batch_size > len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        idx = self._order()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return self.dataset.get(idx)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, sd: dict):
        self.epoch, self.position, self.seed = sd["epoch"], sd["position"], sd["seed"]
        return self


# -- data parallelism: each rank's share -----------------------------------------------------------

class DistributedSampler:
    """This rank's share of a dataset's indices, reshuffled every epoch from ``seed + epoch``.

    Every rank draws the same permutation (same seed and epoch) and takes every ``size``-th index
    starting at its rank, so the shards are disjoint and cover the epoch. ``drop_last=False`` pads
    with the first indices so all shards have equal length (as PyTorch does); ``drop_last=True``
    drops the tail; ``even=False`` does neither: shards differ by at most one sample (use
    ``DistributedDataParallel.backward(loss, n_samples)`` to weigh them right).
    """

    def __init__(self, n: int, rank: int, size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, even: bool = True):
        if not 0 <= rank < size:
            raise ValueError(f"DistributedSampler: rank {rank} is not in 0..{size - 1}")
        if n < 0:
            raise ValueError(f"DistributedSampler: dataset length must be >= 0, got {n}")
        self.n, self.rank, self.size = n, rank, size
        self.shuffle, self.seed, self.drop_last, self.even = shuffle, seed, drop_last, even
        self.epoch = 0

    @classmethod
    def for_comm(cls, dataset, comm, **kw):
        return cls(len(dataset), comm.rank, comm.size, **kw)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def indices(self) -> np.ndarray:
        idx = self._order()
        if self.even and self.n:
            if self.drop_last:
                idx = idx[: self.n - self.n % self.size]
            else:
                pad = (-self.n) % self.size
                idx = np.concatenate([idx, np.resize(idx, pad)]) if pad else idx
        return idx[self.rank::self.size]

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return len(self.indices())


def split_batch(n: int, size: int, rank: int, weights=None) -> slice:
    """Rank ``rank``'s rows of a global batch of ``n`` rows: ``np.array_split`` sizes (the first
    n % size ranks one row more), or sizes proportional to ``weights`` (uneven splits, e.g. for
    ranks of different speed)."""
    if weights is None:
        q, extra = divmod(n, size)
        counts = [q + 1] * extra + [q] * (size - extra)
    else:
        w = np.asarray(weights, float)
        counts = list(np.floor(n * w / w.sum()).astype(int))
        for i in range(n - sum(counts)):
            counts[i % size] += 1
    lo = sum(counts[:rank])
    return slice(lo, lo + counts[rank])
