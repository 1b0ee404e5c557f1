"""Cost model: hardware profiles, operator and collective times, per-device memory."""
from autopar.cost.hardware import PROFILES, Hardware, get_profile, load_hardware, measure_host
from autopar.cost.model import op_flops, op_time, shard_bytes
from autopar.cost.resharding import reshard_time

__all__ = ["PROFILES", "Hardware", "get_profile", "load_hardware", "measure_host", "op_flops",
           "op_time", "reshard_time", "shard_bytes"]
