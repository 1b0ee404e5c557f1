"""8 simulated CPU devices for every test, set before JAX starts; the two test tiers.

Tests that compile and run XLA programs end to end are marked `slow`; the rest (rules, cost,
search, planning) are the fast tier, `make test-fast`, which must stay within 2 minutes on 2
cores. A test outside the slow tier that takes longer than FAST_LIMIT_S is named at the end of
the run, so that the tier stays fast as tests are added.
"""
import json
import os
import shutil
import tempfile

# Tests check what a step computes and what XLA's passes make of it (fusion, buffers,
# collectives), never how fast the CPU kernels run: LLVM's optimisation of those kernels is
# skipped, which takes about a quarter off the suite's compile time, and the CPU compiler
# emits its fusions with its elemental emitters rather than its MLIR fusion emitters, which
# takes about half off what is left (docs/decisions.md, "Where the suite's time goes"). The
# emitters decide how scatters are compiled and fused, and so some of a step's buffers: the
# tests of the CPU buffer model against XLA's program and figure compile as users do
# (helpers.compile_as_users_do).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0"
                           " --xla_cpu_use_fusion_emitters=false").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The test workers of one run share a compilation cache: a program one of them compiled (a
# single-device reference step, an eager op) is read back by the other, and by a new jit of
# the same computation. The first process (xdist's controller, whose environment the workers
# inherit) makes a fresh folder and removes it at the end: every run starts cold, as CI's.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-tests-jax-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# libtpu takes a lock file so that one process owns a host's TPU; compile-only topologies own
# none, and each test worker loads libtpu.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Tests plan afresh: a plan cache of the developer's would answer for the search under test.
os.environ.pop("AUTOPAR_PLAN_CACHE_DIR", None)

import sys  # noqa: E402

import pytest  # noqa: E402

# The example's model zoo (examples/models.py) is shared by tests, example and benchmarks.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

FAST_LIMIT_S = 3.0
_slow_in_fast_tier: list[tuple[str, float]] = []


# Where each tier's time goes: XLA's compiles (or reads of the compilation cache) and
# lowerings to MLIR, summed from JAX's own monitoring events for each test, in this process
# (the subprocesses some tests start are not counted); the rest is autopar's planning,
# tracing, running the steps and the test's own work.
_JAX_EVENTS = {"/jax/core/compile/backend_compile_duration": "XLA compile",
               "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering"}
_event_seconds: dict[str, float] = dict.fromkeys(_JAX_EVENTS.values(), 0.0)
_tier_seconds: dict[str, dict[str, float]] = {}


def _on_jax_event(event: str, seconds: float, **_: object) -> None:
    if event in _JAX_EVENTS:
        _event_seconds[_JAX_EVENTS[event]] += seconds


def pytest_configure(config):
    import jax.monitoring
    jax.monitoring.register_event_duration_secs_listener(_on_jax_event)


_events_at_start = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_events_at_start] = dict(_event_seconds)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if call.when == "call" and report.passed and item.get_closest_marker("slow") is None \
            and report.duration > FAST_LIMIT_S:
        report.user_properties.append(("slow_in_fast_tier", report.duration))
    if call.when == "teardown" and _events_at_start in item.stash:  # the whole test's
        start = item.stash[_events_at_start]
        report.user_properties.append(
            ("jax_seconds", {k: v - start[k] for k, v in _event_seconds.items()}))


def pytest_runtest_logreport(report):
    _slow_in_fast_tier.extend((report.nodeid, s) for k, s in report.user_properties
                              if k == "slow_in_fast_tier")
    tier = "slow" if "slow" in report.keywords else "fast"
    totals = _tier_seconds.setdefault(tier, {"tests": 0, "all": 0.0})
    totals["all"] += report.duration
    totals["tests"] += report.when == "call"
    for name, seconds in next((v for k, v in report.user_properties if k == "jax_seconds"),
                              {}).items():
        totals[name] = totals.get(name, 0.0) + seconds


def pytest_terminal_summary(terminalreporter):
    for tier, totals in sorted(_tier_seconds.items(), reverse=True):
        if not totals["tests"]:
            continue
        parts = ", ".join(f"{name} {totals.get(name, 0.0):.0f} s "
                          f"({totals.get(name, 0.0) / max(totals['all'], 1e-9):.0%})"
                          for name in _JAX_EVENTS.values())
        terminalreporter.write_line(f"{tier} tier: {totals['tests']} tests, {totals['all']:.0f} s "
                                    f"summed over the workers; {parts}")
    if _slow_in_fast_tier:
        terminalreporter.section("fast-tier tests over the limit: mark them slow or make them "
                                 "smaller")
        for nodeid, seconds in sorted(_slow_in_fast_tier, key=lambda t: -t[1]):
            terminalreporter.write_line(f"{seconds:6.1f}s  {nodeid} (limit {FAST_LIMIT_S} s)")


def pytest_collection_modifyitems(config, items):
    """The slow tier first (stable: files keep their order within a tier), so that the
    workers start the long tests early and the short ones fill the end of the run; with
    worksteal (the Makefile), a worker that runs dry takes over the other's queue."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session):
    if _OWN_CACHE and not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# Where the fault and fuzz tests record what they tried and what came of it, one JSON line per
# record (docs/reliability.md is made from them: `make reliability`).
RELIABILITY_LOG = os.environ.get("AUTOPAR_RELIABILITY_LOG")


@pytest.fixture
def reliability(request):
    """`reliability(what, outcomes, lost, measured, profile)`: record that this test tried
    `what`, with a count per outcome ({"refused": 40, "taken": 20}), what was lost and any
    figures measured ({"seconds to stop": 4.2}), as the test found them, when
    AUTOPAR_RELIABILITY_LOG names a file. `profile`: a fuzzing test's AUTOPAR_FUZZ profile."""
    def record(what: str, outcomes, lost: str = "nothing", measured=None,
               profile: str = "") -> None:
        if RELIABILITY_LOG:
            line = json.dumps({"test": request.node.nodeid.split("[")[0], "what": what,
                               "profile": profile, "outcomes": dict(outcomes), "lost": lost,
                               "measured": measured or {}})
            with open(RELIABILITY_LOG, "a") as f:
                f.write(line + "\n")
    return record
