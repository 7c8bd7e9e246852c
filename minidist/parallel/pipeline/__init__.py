"""Pipeline parallelism: schedules as data, the runtime that executes them, the simulator that checks them.

Kept apart, as ShallowSpeed does, so each can be read alone:

* the data -- ``instructions.py`` (what a stage executes), ``placement.py`` (which rank holds each
  piece of the model);
* the schedules -- ``schedule.py`` (GPipe, 1F1B, interleaved), ``zero_bubble.py`` (ZB-H1),
  ``zb_h2.py``, ``zb_v.py``, ``dualpipe.py`` (DualPipeV, two-copy DualPipe), ``greedy.py`` (the list
  scheduler ZB-H2 and a short ZB-V use); ``catalog.py`` names them all (``--schedule``);
* the runtime -- ``stage.py`` (a rank's layers), ``runtime.py`` (``run_schedule``),
  ``split_backward.py`` (B now, W later);
* the cut -- ``partition.py``; the simulator -- ``simulate.py`` (timing, deadlocks, bubble, memory).
"""
