"""Property-based fuzzing: random small train steps, random meshes, random searches.

For every drawn case (a model from fuzz_models.specs(), a mesh of one to three axes over the 8
devices, one of the three searches, maybe a batch annotation, and a schedule: one batch,
gradient accumulation over microbatches, or the model's layer stack pipelined over two stages
of a 'stage' mesh axis), two train steps run
single-device under jax.jit and sharded under autopar.auto_parallel, each from a fresh copy of
the same state. The property: either
autopar refuses the case with an AutoparError, or the sharded run trains as one device does
(losses within rtol, the state within a global relative error). Anything else, any other
exception included, is a failure. An AutoparWarning (an operator replicated for lack of a rule)
is allowed and counted. bf16 steps are judged against the float32 step where their roundings
part (BF16_ACCURACY_FACTOR), and by their losses alone where they pool by max ("loss_only").

Profiles, chosen by the AUTOPAR_FUZZ environment variable:
- "fast" (default, part of `make test`): three explicit cases (one per search) and four drawn
  ones, about a minute and a half.
- "long" (`make fuzz`): 200 examples. It does not stop at the first failure: every failing case
  is recorded and the test fails at the end listing them all, each with the Spec, mesh and
  search that rebuild it (`fuzz_models.build(Spec(...))`).

Neither profile shrinks: a shrink step recompiles a case (seconds each), and the drawn models
are small already. Every case is appended to .pytest_cache/autopar_fuzz/cases-<profile>.jsonl
(outcome, errors measured, seconds), and a summary line is printed at the end (visible with -s)
and written to summary-<profile>.json beside it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import autopar
import fuzz_models
from fuzz_models import Spec
from helpers import copy_tree, global_relative_error, run_steps

pytestmark = pytest.mark.slow  # the slow tier: `make test-fast` leaves it out

STEPS = 2
SEARCHES = ("dynamic_programming", "recursive_programming", "sharding_propagation")
# One to three axes over the 8 devices; a size-1 axis and a mesh using half the devices too.
MESHES = ({"a": 8}, {"a": 2, "b": 4}, {"a": 4, "b": 2}, {"a": 2, "b": 2, "c": 2},
          {"a": 1, "b": 8}, {"a": 2, "b": 1, "c": 4}, {"a": 4})
# (microbatches, pipeline stages[, keep_placement]), one batch first. The models' stacks have
# LAYERS = 2 layers: two stages of one layer each, on a mesh whose 'stage' axis has 2 devices.
SCHEDULES = ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 2, True))
STAGED_MESHES = ({"stage": 2, "a": 4}, {"stage": 2, "a": 2, "b": 2}, {"stage": 2, "a": 1, "b": 4})

# float32: reductions split over devices change only the summation order, so losses agree to
# a few ulps of float32 after two steps (rtol 1e-4 leaves ample room) and the state to far
# better than 1e-3, while two updates move the state by ~1e-1 of its norm (fuzz_models'
# learning rates), so a wrong gradient shows.
# bfloat16 keeps 8 significant bits (a rounding step of 2**-8 = 3.9e-3 relative). bf16
# parameters (computing in float32) round each update, and bf16 activations round every
# contraction's result: split over devices, a contraction rounds its partial sums to bf16 before
# they are all-reduced, so a result differs from one device's by an ulp or two. Measured
# differences reach ~3e-4 on the losses and ~2e-3 on the state; a loss tolerance of about one
# ulp and a state tolerance of about a tenth of the smallest update allow that and still catch
# a wrong gradient.
TOLERANCES = {False: (1e-4, 1e-3), True: (5e-3, 1e-2)}  # uses_bf16 -> (loss rtol, state)
# Where bf16 steps are sensitive enough that the two roundings part by more than that (a
# LayerNorm backward in bf16 amplifies them: one drawn step's single-device state is 1.7e-2 from
# the same step computed in float32, while reordering its batch moves it by only 9e-4), the
# sharded state must be no farther from the float32 computation than the single device's is,
# give or take this factor: a wrong gradient lands an update's size (~1e-1) away.
BF16_ACCURACY_FACTOR = 1.5
# Max pooling is the exception: which position wins among near-equal values depends on how
# the bf16 values round, and a program computing them otherwise (another fusion, a microbatch
# loop) moves a winner's whole gradient elsewhere. The three bf16 cases found failing (two in
# the long runs, one with XLA's excess precision off) all pool by max, and pass with mean
# pooling (1.4e-3 to 3.8e-3 from one device, against 1.9e-2 to 3.1e-2 with max);
# docs/decisions.md. Their losses are still judged.

PROFILE = os.environ.get("AUTOPAR_FUZZ", "fast")
_COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               phases=[Phase.explicit, Phase.generate])
settings.register_profile("fast", max_examples=4, **_COMMON)
settings.register_profile("long", max_examples=200, **_COMMON)
if PROFILE not in ("fast", "long"):
    raise ValueError(f"AUTOPAR_FUZZ={PROFILE!r}: use 'fast' or 'long'")
KEEP_GOING = PROFILE == "long"

LOG_DIR = pathlib.Path(__file__).resolve().parent.parent / ".pytest_cache" / "autopar_fuzz"


# What XLA logs where it reshards a value by replicating it: a plan must compile without it.
XLA_WARNING = "Involuntary full rematerialization"


class CaseFailure(AssertionError):
    """A drawn case broke the property."""


@st.composite
def settings_for_case(draw) -> tuple[dict[str, int], str, str | None, tuple[int, int]]:
    """(mesh, search, batch axis, schedule): the axis that the batch's data and labels are
    annotated to be split over, or None; the schedule as (microbatches, stages[,
    keep_placement]), the mesh one with a 'stage' axis where the stages are more than one.
    sharding_propagation spreads annotations and refuses a step without any, so it always gets
    one; the other searches get one half the time."""
    schedule = draw(st.sampled_from(SCHEDULES))
    mesh = draw(st.sampled_from(MESHES if schedule[1] == 1 else STAGED_MESHES))
    search = draw(st.sampled_from(SEARCHES))
    axis = None
    if search == "sharding_propagation" or draw(st.booleans()):
        axis = draw(st.sampled_from(list(mesh)))
    return mesh, search, axis, schedule


def annotations_for(axis: str | None) -> dict | None:
    # Only the data and labels: the dropout key (when present) is no batch.
    return None if axis is None else {r"^batch/(inputs|targets)$": P(axis)}


def check_case(spec: fuzz_models.Spec, mesh: dict[str, int], search: str,
               axis: str | None = None, schedule: tuple[int, int] = (1, 1)) -> dict:
    """Run one case; return its record, raising CaseFailure if the property fails."""
    record = {"spec": repr(spec), "mesh": mesh, "search": search, "batch_axis": axis,
              "schedule": schedule}
    microbatches, stages, *keep = schedule
    step, state, batch = fuzz_models.build(spec)
    if microbatches > 1 and "dropout" in batch:
        # Split into microbatches, every leaf of the batch but a scalar must hold examples:
        # the raw key's (2,) would be refused, so the key goes typed (the same bits).
        batch = {**batch, "dropout": jax.random.wrap_key_data(batch["dropout"])}
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), batch, STEPS)
    assert np.all(np.isfinite(ref_losses)), f"the grammar drew a diverging model: {ref_losses}"
    try:
        with warnings.catch_warnings(record=True) as caught, xla_log() as log:
            warnings.simplefilter("always", autopar.AutoparWarning)
            sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(mesh), search=search,
                                            annotations=annotations_for(axis),
                                            microbatches=microbatches, pipeline=stages,
                                            keep_placement=bool(keep))
            new_state, losses = run_steps(sharded, copy_tree(state), batch, STEPS)
            new_state = autopar.unpack(new_state)
    except autopar.AutoparError as e:
        return record | {"outcome": "autopar_error", "error": str(e).splitlines()[0]}
    except Exception as e:  # noqa: BLE001 - anything but an AutoparError breaks the property
        raise CaseFailure(f"{type(e).__name__}: {e}\n{traceback.format_exc()}") from e
    fallbacks = [str(w.message).splitlines()[0] for w in caught
                 if issubclass(w.category, autopar.AutoparWarning)]
    loss_rtol, state_tol = TOLERANCES[spec.uses_bf16]
    loss_err = float(np.max(np.abs(np.subtract(losses, ref_losses)) / np.abs(ref_losses)))
    state_err = global_relative_error(ref_state, new_state)
    # How far training moved the state: the state tolerance is meaningful only well below it.
    update = global_relative_error(state, ref_state)
    xla_warnings = [line for line in log if XLA_WARNING in line]
    record |= {"outcome": "warned" if fallbacks else "ok", "warnings": fallbacks,
               "xla_warnings": xla_warnings, "loss_err": loss_err, "state_err": state_err,
               "update": update}
    problems = [f"XLA warned while compiling the plan: {w}" for w in xla_warnings]
    if not loss_err <= loss_rtol:
        problems.append(f"losses {losses} vs single-device {ref_losses} "
                        f"(relative error {loss_err:.2e} > {loss_rtol:g})")
    if not state_err <= state_tol and spec.uses_bf16:
        truth = float32_reference(spec, state, batch)
        single, ours = global_relative_error(truth, ref_state), global_relative_error(truth,
                                                                                     new_state)
        record |= {"float32_err_single": single, "float32_err_sharded": ours}
        if spec.pool == "max" and not ours <= BF16_ACCURACY_FACTOR * single:
            record["outcome"] = "loss_only"  # bf16 max pooling: near-ties' winners flip
        elif not ours <= BF16_ACCURACY_FACTOR * single:
            problems.append(f"state differs from single-device by {state_err:.2e} > "
                            f"{state_tol:g}, and from the float32 step by {ours:.2e}, more than "
                            f"{BF16_ACCURACY_FACTOR}x the single device's {single:.2e}")
    elif not state_err <= state_tol:
        problems.append(f"state differs from single-device by {state_err:.2e} > {state_tol:g}")
    if problems:
        raise CaseFailure("; ".join(problems))
    return record


@contextlib.contextmanager
def xla_log():
    """The lines XLA writes to the process's stderr meanwhile, in the list it yields, filled
    on exit (XLA's C++ log bypasses sys.stderr, and pytest's capfd cannot be read per
    hypothesis example)."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            lines.extend(log.read().splitlines())


def float32_reference(spec: fuzz_models.Spec, state, batch):
    """The state after the same steps computed in float32 (highest matmul precision) from the
    same initial values: what a bf16 step, single-device or sharded, approximates."""
    step32, like, _ = fuzz_models.build(dataclasses.replace(spec, dtype="float32"))
    start = jax.tree_util.tree_map(
        lambda x: x.astype(np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    assert jax.tree_util.tree_structure(start) == jax.tree_util.tree_structure(like)
    with jax.default_matmul_precision("highest"):
        return run_steps(jax.jit(step32), start, batch, STEPS)[0]


class Summary:
    """Counts and the per-case log of one test run."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log = open(LOG_DIR / f"cases-{PROFILE}.jsonl", "w")
        self.start = time.perf_counter()

    def add(self, record: dict) -> None:
        self.counts[record["outcome"]] += 1
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()

    def line(self) -> str:
        total = sum(n for k, n in self.counts.items() if k != "repeated")
        parts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        return (f"autopar fuzz ({PROFILE}): {total} cases in "
                f"{time.perf_counter() - self.start:.0f} s: {parts}")

    def close(self) -> None:
        self.log.close()
        (LOG_DIR / f"summary-{PROFILE}.json").write_text(json.dumps(
            {"profile": PROFILE, "counts": self.counts, "failures": self.failures}, indent=1))


def test_fuzz_matches_single_device(reliability):
    summary = Summary()
    seen = set()

    @settings.get_profile(PROFILE)
    @given(spec=fuzz_models.specs(), case=settings_for_case())
    @example(spec=Spec(batch=16, seq=8, width=16, heads=4, inputs="tokens",
                       blocks=("einsum_attention", "dense"), norm="layer", dropout=True,
                       stack="nn_scan", head="tied", optimizer="adamw"),
             case=({"a": 2, "b": 4}, "sharding_propagation", "a", (1, 1)))
    @example(spec=Spec(batch=8, width=8, inputs="image", strided=True, blocks=("mixer",),
                       remat=True, lax_scan=True, pool="max", dtype="bf16_compute"),
             case=({"a": 2, "b": 2, "c": 2}, "dynamic_programming", None, (1, 1)))
    @example(spec=Spec(batch=16, seq=4, width=32, heads=2, blocks=("attention", "heads"),
                       norm="rms", pool="mean", head="regression", dtype="bf16_params",
                       optimizer="adamw"),
             case=({"a": 1, "b": 8}, "recursive_programming", "b", (1, 1)))
    # bf16 throughout, blocks split over the width: partial sums rounded to bf16 before their
    # all-reduce part from one device's by more than TOLERANCES allow (float32 criterion).
    @example(spec=Spec(batch=16, seq=4, width=32, heads=2, blocks=("dense", "conv"),
                       norm="layer", stack="nn_scan", pool="max", head="regression",
                       dtype="bf16", optimizer="sgd", seed=1),
             case=({"a": 4}, "dynamic_programming", None, (1, 1)))
    # Found by the long run. A bf16 step with a loop that the plan keeps whole: pinning its
    # body cut XLA's fusions and their float32 (2.4e-2 from one device, 3x its distance from
    # the float32 step).
    @example(spec=Spec(batch=16, seq=8, width=8, heads=2, inputs="tokens",
                       blocks=("mixer", "mixer"), norm="layer", lax_scan=True, pool="max",
                       head="regression", dtype="bf16"),
             case=({"a": 4}, "dynamic_programming", None, (1, 1)))
    # Dropout in a checkpointed layer, accumulated: the draw inside the call was never made
    # at the full batch (a KeyError).
    @example(spec=Spec(batch=16, seq=8, width=8, heads=4, blocks=("attention",), dropout=True,
                       remat=True, lax_scan=True),
             case=({"a": 2, "b": 4}, "dynamic_programming", "b", (4, 1)))
    @example(spec=Spec(batch=16, seq=4, width=16, inputs="tokens", blocks=("dense",),
                       norm="rms", stack="nn_scan", head="tied", optimizer="adamw"),
             case=({"stage": 2, "a": 4}, "dynamic_programming", None, (4, 2)))
    # A checkpointed loop body in a pipelined stage, bound as a scan: XLA moved a bias from
    # the stage axis onto the features inside the recomputation by replicating it (XLA_WARNING).
    @example(spec=Spec(batch=16, seq=8, width=8, heads=2, inputs="tokens",
                       blocks=("einsum_attention", "heads"), remat=True, lax_scan=True,
                       pool="mean", head="regression", dtype="bf16", optimizer="sgd", seed=2),
             case=({"stage": 2, "a": 2, "b": 2}, "recursive_programming", None, (4, 2)))
    # Checkpointed depthwise convolutions: a value read through the recomputation's barrier
    # was left for XLA to place; it split it over the channels, and then could not give the
    # convolution's result the batch split pinned (XLA_WARNING).
    @example(spec=Spec(batch=8, seq=8, width=8, heads=2, inputs="features",
                       blocks=("depthwise", "depthwise"), norm="layer", remat=True, pool="sum",
                       head="classes", optimizer="adamw", seed=3),
             case=({"a": 4, "b": 2}, "sharding_propagation", "b", (1, 1)))
    def prop(spec, case):
        mesh, search, axis, schedule = case
        if schedule[1] > 1 and spec.stack == "none" and not spec.lax_scan:
            schedule = (schedule[0], 1)  # no layer stack to pipeline: accumulation alone
        key = (spec, tuple(mesh.items()), search, axis, schedule)
        if key in seen:  # hypothesis may draw a passed case again; it would only cost time
            summary.counts["repeated"] += 1
            return
        t0 = time.perf_counter()
        try:
            record = check_case(spec, mesh, search, axis, schedule)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            detail = str(e) if len(str(e)) < 6000 else f"{str(e)[:2000]}\n...\n{str(e)[-4000:]}"
            summary.add({"spec": repr(spec), "mesh": mesh, "search": search, "batch_axis": axis,
                         "schedule": schedule, "outcome": "failed", "error": first, "detail": detail,
                         "seconds": round(time.perf_counter() - t0, 1)})
            if not KEEP_GOING:
                raise  # and hypothesis replays this case to report it: it must fail again
            seen.add(key)
            summary.failures.append(f"check_case({spec!r}, {mesh}, {search!r}, {axis!r}, "
                                    f"{schedule}):\n"
                                    f"    {type(e).__name__}: {first}")
            return
        seen.add(key)
        summary.add(record | {"seconds": round(time.perf_counter() - t0, 1)})

    try:
        prop()
    finally:
        print("\n" + summary.line())
        summary.close()
        reliability("random train steps, meshes, searches and schedules, sharded against "
                    "one device", summary.counts,
                    f"{summary.counts['failed']} steps computed wrong or crashed", profile=PROFILE)
    if summary.failures:
        raise AssertionError(f"{len(summary.failures)} failing cases:\n" +
                             "\n".join(summary.failures))
