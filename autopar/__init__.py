"""autopar: automatic parallelism for JAX training steps.

Decorate an ordinary single-device step with `auto_parallel(mesh=...)` and it runs sharded over
the mesh, with a strategy chosen by search under a cost model, readable as a `Plan`.
"""
import os as _os

from jax.extend import source_info_util as _source_info_util

# An equation autopar's own code makes (autopar.shard, a rewrite's marks and loops) names the
# user's line that led to it, as JAX's own equations do: a plan names lines its reader can
# open, and reads the same wherever autopar is installed.
_source_info_util.register_exclusion(_os.path.dirname(__file__) + _os.sep)

from autopar.api import AutoParallel, auto_parallel, plan
from autopar.checkpoint import (checkpoint_plan, latest_checkpoint, restore_checkpoint,
                                save_checkpoint, wait_for_checkpoints)
from autopar.cost.calibrate import calibrate
from autopar.cost.hardware import PROFILES, Hardware, load_hardware, measure_host
from autopar.cost.judge import Evaluation, evaluate
from autopar.distributed import global_batch, is_main_process, process_rows
from autopar.errors import AutoparError, AutoparWarning, MemoryLimitError
from autopar.mesh import make_mesh
from autopar.placement.stored import Placed, unpack
from autopar.plan import OpDecision, Plan, Redistribution, TensorPlan, load_plan
from autopar.plan_cache import plan_cache_dir, set_plan_cache_dir
from autopar.plan_stats import Cost, SearchStats
from autopar.plan_diff import PlanDiff, diff
from autopar.preemption import Preemption
from autopar.rewrite.accumulate import grad, value_and_grad
from autopar.trace.shard import shard

__all__ = ["AutoParallel", "auto_parallel", "plan", "shard", "value_and_grad", "grad",
           "PROFILES", "Hardware", "measure_host", "calibrate", "load_hardware", "AutoparError",
           "MemoryLimitError", "Evaluation", "evaluate", "AutoparWarning", "make_mesh",
           "OpDecision", "Plan", "Cost", "SearchStats", "Redistribution", "TensorPlan",
           "load_plan", "save_checkpoint",
           "restore_checkpoint", "checkpoint_plan", "latest_checkpoint", "wait_for_checkpoints",
           "Preemption", "diff", "PlanDiff", "set_plan_cache_dir", "plan_cache_dir",
           "process_rows", "global_batch", "is_main_process", "Placed", "unpack"]
__version__ = "0.1.0"
