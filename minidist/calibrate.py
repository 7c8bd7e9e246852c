"""``python -m minidist.calibrate``: the command that measures this machine for the planner.

The measurements are ``minidist/plan/calibrate.py``; this module only keeps the command.
"""

from minidist.plan.calibrate import main

if __name__ == "__main__":
    main()
