"""minidist: distributed training and inference of neural networks, from scratch.

Start with ``minidist.autograd.tensor`` (autograd), ``minidist.nn`` (models), ``minidist.comm``
(communication) and ``minidist.parallel`` (the techniques). See README.md and lessons/.
"""

from minidist.accel.backend import get_backend
from minidist.autograd import fused as _fused  # noqa: F401 - registers the ops' fast forms (ops.FAST)
from minidist.autograd.tensor import Tensor, no_grad, tensor
from minidist.comm import run as _run
from minidist.comm import runner as _runner
from minidist.resilience import heartbeat as _heartbeat

# machinery attached when minidist is imported: a supervised rank tells the supervisor it is up (and
# watches it), and which rank ended the job
_runner.ON_RANK_START.append(_heartbeat.started)
_runner.ON_RANK_ERROR.append(_heartbeat.ended_job)

__all__ = ["Tensor", "get_backend", "no_grad", "tensor", "run"]
__version__ = "0.1.0"


def run(fn, ranks=None, **kwargs):
    """Run ``fn(comm, **kwargs)`` on every rank: MPI under mpirun, else ``ranks`` threads."""
    return _run(fn, ranks=ranks, **kwargs)
