"""Dynamic load balancing: see stragglers, then move work while training runs.

* measure.py  -- ``StepMonitor`` (per-rank compute and wait time each step, agreed by one tiny
  all-gather, smoothed over a window) and ``StragglerDetector`` (a rank slower than the median by a
  threshold for n steps).
* shares.py   -- ``proportional_shares`` (a global batch split in proportion to throughput),
  ``balanced_time`` (B / Σ speed_i) and ``ShareBalancer`` (re-decide every k steps, with hysteresis).
* profile.py  -- ``ProfiledStage``: a pipeline stage timing each of its layers while training.
* repartition.py -- ``move_layers`` (layers, their parameters and optimizer state, moved between
  stages at a step boundary), the 1F1B ``step_time`` of a cut, and when a move ``pays_off``.
* dp.py, pipeline.py -- the training loops: ``train_dp_balanced`` (moving shares; DDP's
  global-sample weighting keeps the gradient the whole batch's) and ``train_pipeline_balanced``
  (the min-max cut, ``pipeline.partition_balanced``, of the profiled costs, moved when it pays).
"""

from minidist.parallel.balance.measure import StepMonitor, StragglerDetector
from minidist.parallel.balance.shares import ShareBalancer, balanced_time, offsets, proportional_shares

__all__ = ["ShareBalancer", "StepMonitor", "StragglerDetector", "balanced_time", "offsets",
           "proportional_shares"]
