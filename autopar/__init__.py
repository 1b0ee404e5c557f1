"""autopar: automatic parallelism for JAX training steps.

Decorate an ordinary single-device step with `auto_parallel(mesh=...)` and it runs sharded over
the mesh, with a strategy chosen by search under a cost model, readable as a `Plan`.
"""
from autopar.accumulate import grad, value_and_grad
from autopar.api import AutoParallel, auto_parallel, plan
from autopar.cost.hardware import PROFILES, Hardware, measure_host
from autopar.cost.judge import Evaluation, evaluate
from autopar.errors import AutoparError, MemoryLimitError
from autopar.mesh import make_mesh
from autopar.plan import OpDecision, Plan, Redistribution, TensorPlan, load_plan
from autopar.planning.problem import AutoparWarning
from autopar.trace.shard import shard

__all__ = ["AutoParallel", "auto_parallel", "plan", "shard", "value_and_grad", "grad",
           "PROFILES", "Hardware", "measure_host", "AutoparError", "MemoryLimitError",
           "Evaluation", "evaluate", "AutoparWarning", "make_mesh", "OpDecision", "Plan",
           "Redistribution", "TensorPlan", "load_plan"]
__version__ = "0.1.0"
