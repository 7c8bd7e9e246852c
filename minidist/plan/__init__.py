"""The planner: memory and step time of any mesh at any scale (`python -m minidist.plan`).

* model.py    -- `ModelSpec`: shape, parameters, FLOPs, activation bytes (minidist's exact, Megatron's)
* presets.py  -- GPT-3 175B, a 1T GPT, Llama-3 8B/70B/405B, PaLM 540B, a Gemini-like MoE; published runs
* mesh.py     -- `Candidate` (dp, tp, pp, cp, ep, ZeRO, checkpointing, microbatch_size, schedule), `memory`
* traffic.py  -- the collectives of one step per axis, bytes per rank (exact for minidist)
* layout.py   -- which layers each pipeline stage and chunk holds
* steptime.py -- compute, exposed communication per axis on its link, simulated bubble, MFU; its parts:
                 compute.py (math per stage), links.py (an axis' link, a collective's time),
                 sharing.py (ranks sharing this machine's cores)
* schedules.py -- every pipeline schedule's bubble and peak activations, by its paper's formula
* pipeline_costs.py -- a stage's measured F, B, W and the step the simulator predicts from them
* search.py   -- enumerate, rank, explain; report.py -- the table and the plot
Hardware constants: `minidist.plan.hardware`; this machine's: `python -m minidist.calibrate`
(calibrate.py, with clock.py, calibrate_kernels.py, calibrate_cores.py, calibrate_mpi.py).
"""

from minidist.plan.mesh import Candidate, Settings, memory
from minidist.plan.model import ModelSpec
from minidist.plan.presets import MODELS, RUNS
from minidist.plan.search import plan
from minidist.plan.steptime import Prediction, predict
from minidist.plan.traffic import collectives

__all__ = ["MODELS", "RUNS", "Candidate", "ModelSpec", "Prediction", "Settings", "collectives", "memory",
           "plan", "predict"]
