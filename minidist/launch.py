"""``python -m minidist.launch``: the command that starts, watches and restarts a job.

The supervisor itself is ``minidist/resilience/supervisor.py``; this module only keeps the command.
"""

import sys

from minidist.resilience.supervisor import main

if __name__ == "__main__":
    sys.exit(main())
