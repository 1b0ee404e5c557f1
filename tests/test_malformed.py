"""Malformed inputs never crash: property-based tests that mutate what a user hands autopar.

A valid plan's JSON, a hardware profile and auto_parallel's options are mutated at random (a
value replaced by another JSON value or a wrong-typed one, a key or list entry deleted, the text
cut short). The property: autopar either raises an AutoparError or takes the input, and a step
run under a mutated plan or options computes what the single-device step computes. Any other
exception is a failure.

Profiles, by the AUTOPAR_FUZZ environment variable as in test_fuzz.py: "fast" (default, in
`make test` and `make test-fast`) draws a few dozen cases per test, "long" (`make fuzz`) a
thousand plan mutations and hundreds of option sets. Each test's outcomes (how many inputs were
refused, taken, and run) are recorded for the reliability table (conftest's `reliability`).
"""
from __future__ import annotations

import json
import os
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import autopar

PROFILE = os.environ.get("AUTOPAR_FUZZ", "fast")
_COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=True,
               suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
EXAMPLES = {"fast": {"plan": 60, "apply": 8, "options": 8, "hardware": 60},
            "long": {"plan": 1000, "apply": 150, "options": 150, "hardware": 500}}[PROFILE]
MESH = {"data": 2, "model": 4}


def _step(params, batch):
    """A two-layer MLP's SGD step: the state handed back, and the loss."""
    def loss(p):
        hidden = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
        return jnp.mean((hidden @ p["w2"] - batch["y"]) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), value


def _state():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "b1": jnp.zeros((32,)),
              "w2": jax.random.normal(k2, (32, 8)) * 0.3}
    batch = {"x": jax.random.normal(k3, (8, 16)), "y": jnp.ones((8, 8))}
    return params, batch


@pytest.fixture(scope="module")
def reference():
    """The single-device result, a valid plan (compact and detailed JSON) and the mesh."""
    params, batch = _state()
    mesh = autopar.make_mesh(MESH)
    stepped = autopar.auto_parallel(_step, mesh=mesh)
    plan = stepped.plan(params, batch)
    return {"result": jax.jit(_step)(params, batch), "mesh": mesh,
            "texts": (plan.to_json(), plan.to_json(detail=True))}


# -- mutations of a JSON document -------------------------------------------------------------
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["P('data')", "P('nope')", "P(('data', 'data'))",
                                           "P(", "data", "model", "P(None, 'model', 'data')"]),
    st.lists(st.integers(-3, 70), max_size=4), st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=2))


def _mutated(draw, body, depth=0):
    """`body` with one change somewhere inside it, drawn step by step down the tree."""
    containers = isinstance(body, (dict, list)) and len(body) > 0
    if not containers or depth > 6 or draw(st.integers(0, 4)) == 0:
        return draw(JUNK)
    keys = list(body) if isinstance(body, dict) else list(range(len(body)))
    key = draw(st.sampled_from(keys))
    copy = dict(body) if isinstance(body, dict) else list(body)
    if draw(st.integers(0, 5)) == 0:  # delete the entry
        del copy[key]
        return copy
    copy[key] = _mutated(draw, body[key], depth + 1)
    return copy


# Specs a plan on MESH could hold: a plan with them in other places loads, and must run right.
SPECS = ["P()", "P('data')", "P('model')", "P(None, 'model')", "P('model', 'data')",
         "P(('data', 'model'))", "P(None, None, 'data')"]


def _respecified(draw, body):
    """`body` with one of its specs (a "P(...)" string) replaced by another over MESH's axes."""
    if isinstance(body, dict):
        keys = list(body)
    elif isinstance(body, list):
        keys = list(range(len(body)))
    else:
        return draw(st.sampled_from(SPECS)) if isinstance(body, str) and body.startswith(
            "P(") else body
    holding = [k for k in keys if "P(" in json.dumps(body[k])]
    if not holding:
        return body
    key = draw(st.sampled_from(holding))
    copy = dict(body) if isinstance(body, dict) else list(body)
    copy[key] = _respecified(draw, body[key])
    return copy


@st.composite
def mutated_texts(draw, texts):
    """A plan's JSON cut short, with values of the wrong kind, or with other specs."""
    text = texts[draw(st.integers(0, len(texts) - 1))]
    kind = draw(st.integers(0, 7))
    if kind == 0:
        return text[:draw(st.integers(0, len(text) - 1))]  # a file cut short
    body = json.loads(text)
    for _ in range(draw(st.integers(1, 3))):
        body = _respecified(draw, body) if kind >= 4 else _mutated(draw, body)
    return json.dumps(body)


def _outcome(counts: Counter, fn):
    """Run `fn`; count an AutoparError as refused. Any other exception fails the test."""
    try:
        value = fn()
    except autopar.AutoparError as e:
        assert str(e).strip(), "an AutoparError must say what is wrong"
        counts["refused"] += 1
        return None
    counts["taken"] += 1
    return value


def _same_result(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_mutated_plan_json_loads_or_is_refused(reference, reliability):
    counts: Counter = Counter()

    @settings(max_examples=EXAMPLES["plan"], **_COMMON)
    @given(st.data())
    def check(data):
        text = data.draw(mutated_texts(reference["texts"]))
        plan = _outcome(counts, lambda: autopar.Plan.from_json(text))
        if plan is not None:  # a plan that loads can be read
            assert plan.summary() and autopar.Plan.from_json(plan.to_json()) == plan

    check()
    reliability("plan JSON mutated, then loaded", counts, profile=PROFILE)
    assert counts["refused"] > 0 and sum(counts.values()) == EXAMPLES["plan"]


@pytest.mark.slow
def test_mutated_plan_applies_right_or_is_refused(reference, reliability):
    """A mutated plan that loads either is refused when applied or computes the right step."""
    counts: Counter = Counter()
    params, batch = _state()

    @settings(max_examples=EXAMPLES["apply"], **_COMMON)
    @given(st.data())
    def check(data):
        text = data.draw(mutated_texts(reference["texts"]))
        plan = _outcome(Counter(), lambda: autopar.Plan.from_json(text))
        if plan is None:
            counts["refused"] += 1
            return
        step = autopar.auto_parallel(_step, mesh=reference["mesh"], plan=plan)
        got = _outcome(counts, lambda: step(params, batch))
        if got is not None:
            _same_result(got, reference["result"])

    check()
    reliability("plan JSON mutated, then applied to a step", counts,
                "nothing: every step run computed what one device does", profile=PROFILE)
    assert sum(counts.values()) == EXAMPLES["apply"]


def test_applied_plan_on_other_axis_names_is_refused(reference):
    plan = autopar.Plan.from_json(reference["texts"][1])
    mesh = autopar.make_mesh({"dp": 2, "mp": 4})
    with pytest.raises(autopar.AutoparError, match=r"axes \('data', 'model'\).*\('dp', 'mp'\)"):
        autopar.auto_parallel(_step, mesh=mesh, plan=plan)(*_state())


def test_newer_plan_version_is_refused(reference):
    body = json.loads(reference["texts"][0])
    body["format_version"] += 1
    with pytest.raises(autopar.AutoparError, match="newer autopar"):
        autopar.Plan.from_json(json.dumps(body))


def test_missing_plan_file_is_refused(tmp_path):
    for path in (tmp_path / "none.json", tmp_path):
        with pytest.raises(autopar.AutoparError, match=str(path)):
            autopar.load_plan(str(path))


# -- options ----------------------------------------------------------------------------------
OPTIONS = {
    "mesh": st.sampled_from([MESH, {"data": 8}, {"a": 3}, {"a": 16}, {"a": 0}, {"a": -2},
                             {"": 8}, {3: 8}, 8, 0, -1, "auto", "nope", None, 2.5, [2, 4]]),
    "search": st.sampled_from(["dynamic_programming", "recursive_programming",
                               "sharding_propagation", "nope", None, 3]),
    "hardware": st.sampled_from([None, "cpu", "h100", "tpu_v5p", "nope", 3, {"flops": 1}]),
    "memory_limit": st.sampled_from([None, "auto", 2**30, 1, 0, -5, "16GiB", "16 GB", "lots",
                                     1.5e9, True]),
    "microbatches": st.sampled_from([1, 2, 4, 3, 0, -1, "auto", "x", 2.0, None]),
    "pipeline": st.sampled_from([1, 2, 0, -2, "auto", "x", None]),
    "annotations": st.one_of(
        st.dictionaries(  # input paths, or regexes (some of them broken), to specs or junk
            st.sampled_from(["params/w1", "params/b1", "batch/x", "batch/y", "params/.*",
                             "batch/.*", "^nothing$", "(", "w2$"]),
            st.one_of(st.lists(st.sampled_from([None, "data", "model", ("data", "model"),
                                                "nope", ("data", "data")]), max_size=3)
                      .map(lambda dims: P(*dims)),
                      st.sampled_from([5, "data", None, ("data",)])),
            max_size=3),
        st.sampled_from([None, "P('data')", [P()], 3])),
}


VALID = {"mesh": MESH, "search": "dynamic_programming"}


@pytest.mark.slow
def test_mutated_options_plan_right_or_are_refused(reference, reliability):
    """A valid set of options with one to three of them drawn from OPTIONS instead."""
    counts: Counter = Counter()
    params, batch = _state()

    @settings(max_examples=EXAMPLES["options"], **_COMMON)
    @given(st.lists(st.sampled_from(sorted(OPTIONS)), min_size=1, max_size=3, unique=True),
           st.data())
    def check(changed, data):
        options = {**VALID, **{k: data.draw(OPTIONS[k], label=k) for k in changed}}
        options = {k: v for k, v in options.items() if v is not None}
        mesh = options.pop("mesh", MESH)

        def run():
            made = autopar.make_mesh(mesh) if isinstance(mesh, dict) else mesh
            return autopar.auto_parallel(_step, mesh=made, **options)(params, batch)
        got = _outcome(counts, run)
        if got is not None:
            _same_result(got, reference["result"])

    check()
    reliability("auto_parallel options drawn at random", counts,
                "nothing: every step run computed what one device does", profile=PROFILE)
    assert counts["refused"] > 0 and sum(counts.values()) == EXAMPLES["options"]


def test_mutated_hardware_profile_loads_or_is_refused(tmp_path, reliability):
    counts: Counter = Counter()
    text = autopar.PROFILES["tpu_v5p"].to_json()

    @settings(max_examples=EXAMPLES["hardware"], **_COMMON)
    @given(st.data())
    def check(data):
        mutated = data.draw(mutated_texts((text,)))
        path = tmp_path / "profile.json"
        path.write_text(mutated)
        hw = _outcome(counts, lambda: autopar.load_hardware(str(path)))
        if hw is not None:  # a profile that loads can price a plan (or find none fits)
            _outcome(Counter(), lambda: autopar.plan(_step, *_state(), mesh=MESH, hardware=hw))

    check()
    reliability("hardware profile mutated, then loaded", counts, profile=PROFILE)
    assert counts["refused"] > 0 and sum(counts.values()) == EXAMPLES["hardware"]
