"""Exercise 10: the two pieces of checkpointing that make a restart safe.

A crash can happen at any instant -- in the middle of writing a file, between two renames. A
checkpoint is only useful if, whatever instant that was, the job restarts from a checkpoint that
is whole. And a job restarted on another number of ranks must rebuild its shards from the old ones.

Estimated time: 1 h (atomic save 35 min, resharded load 25 min)
Grade it:  python -m minidist.grade fault_tolerance
The grader crashes your save at every file operation in turn (open, write, fsync, rename, ...) and
checks that what ``latest`` points to is always a whole checkpoint, old or new; and it reshards
random arrays between random numbers of ranks, counting which old shards you read.
Lesson: lessons/10-fault-tolerance.md; minidist's answer is minidist/resilience/checkpoint/ (files.py:
begin_step, commit_step; layout.py: assemble), so try before you look.
"""

import hashlib  # noqa: F401  (you will need it)
import json  # noqa: F401
import os  # noqa: F401

import numpy as np  # noqa: F401


def atomic_save(root, step, arrays):
    """Save ``arrays`` (name -> NumPy array) as checkpoint ``step`` under directory ``root``, atomically.

    The result on disk:
        root/step-{step:08d}/NAME.npy        one file per array (``np.save``)
        root/step-{step:08d}/manifest.json   {"step": step, "files": {"NAME.npy": "<sha256 hex of the file>"}}
        root/latest                          the text "step-{step:08d}" (no newline needed)

    Atomic: if the process dies at ANY point during the call, ``root/latest`` must still name a
    complete checkpoint (the previous one, or this one) whose files all match their sha256. So:
    write everything into a temporary directory (``root`` may hold leftovers of a crashed earlier
    attempt: remove them), flush and ``os.fsync`` each file, write the manifest, rename the directory
    to its final name (``os.replace``/``os.rename`` are atomic), and only then replace ``latest``
    the same way: write ``latest.tmp``, fsync, ``os.replace`` it onto ``latest``. Never open
    ``latest`` itself for writing. If ``step-{step:08d}`` already exists, the new one replaces it.
    Use ``open``, ``np.save`` (to an open file), ``os.fsync``, ``os.replace``/``os.rename``,
    ``os.makedirs`` and ``shutil.rmtree``.
    Does not modify its inputs.
    """
    raise NotImplementedError


def load_shard(read_piece, shape, dtype, axis, old_size, new_rank, new_size):
    """Rank ``new_rank``'s shard (of ``new_size``) of a tensor saved by ``old_size`` ranks.

    The full tensor has ``shape`` and ``dtype``; it was saved split along ``axis`` into ``old_size``
    equal contiguous blocks, block r by old rank r; ``read_piece(r)`` reads block r from disk (an
    array, expensive). Return the new shard: block ``new_rank`` of the tensor split along ``axis``
    into ``new_size`` equal blocks (both sizes divide ``shape[axis]``). Read ONLY the old blocks
    that overlap the new one, each at most once -- a rank of a 1000-rank job must not read the
    whole model. Example: shape (12,), old_size 3 (blocks [0,4) [4,8) [8,12)), new_size 2,
    new_rank 1 wants [6,12): read blocks 1 and 2, keep elements 2..3 of block 1 and all of block 2.
    Does not modify its inputs.
    """
    raise NotImplementedError
