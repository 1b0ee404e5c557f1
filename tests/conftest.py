"""8 simulated CPU devices for every test, set before JAX starts."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a lock file so that one process owns a host's TPU; compile-only topologies own
# none, and each test worker loads libtpu.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import sys  # noqa: E402

# The example's model zoo (examples/models.py) is shared by tests, example and benchmarks.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
