"""Dynamic load balancing: see stragglers, then move work while training runs.

* measure.py  -- ``StepMonitor`` (per-rank compute and wait time each step, agreed by one tiny
  all-gather, smoothed over a window) and ``StragglerDetector`` (a rank slower than the median by a
  threshold for n steps).
* shares.py   -- ``proportional_shares`` (a global batch split in proportion to throughput),
  ``balanced_time`` (B / Σ speed_i) and ``ShareBalancer`` (re-decide every k steps, with hysteresis).
* dp.py       -- ``train_dp_balanced``: data parallelism with moving shares; DDP's global-sample
  weighting keeps the gradient that of the whole batch, so it equals the serial twin.
* pipeline.py -- ``train_pipeline_balanced``: per-layer times profiled while training; the min-max
  contiguous partition (``pipeline.partition_balanced``); layers, their parameters and optimizer
  state moved between stages at a step boundary when that pays for itself.
"""

from minidist.parallel.balance.measure import StepMonitor, StragglerDetector
from minidist.parallel.balance.shares import ShareBalancer, balanced_time, offsets, proportional_shares

__all__ = ["ShareBalancer", "StepMonitor", "StragglerDetector", "balanced_time", "offsets",
           "proportional_shares"]
