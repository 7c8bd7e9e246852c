"""The planner: memory and step time of any mesh at any scale (`python -m minidist.plan`).

* model.py    -- `ModelSpec`: shape, parameters, FLOPs, activation bytes (minidist's exact, Megatron's)
* presets.py  -- GPT-3 175B, a 1T GPT, Llama-3 8B/70B/405B, PaLM 540B, a Gemini-like MoE; published runs
* mesh.py     -- `Candidate` (dp, tp, pp, cp, ep, ZeRO, checkpointing, microbatch_size, schedule), `memory`
* traffic.py  -- the collectives of one step per axis, bytes per rank (exact for minidist)
* steptime.py -- compute, exposed communication per axis on its link, simulated bubble, MFU
* search.py   -- enumerate, rank, explain
Hardware constants: `minidist.plan.hardware`; this machine's: `python -m minidist.calibrate`.
"""

from minidist.plan.mesh import Candidate, Settings, memory
from minidist.plan.model import ModelSpec
from minidist.plan.presets import MODELS, RUNS
from minidist.plan.search import plan
from minidist.plan.steptime import Prediction, predict
from minidist.plan.traffic import collectives

__all__ = ["MODELS", "RUNS", "Candidate", "ModelSpec", "Prediction", "Settings", "collectives", "memory",
           "plan", "predict"]
