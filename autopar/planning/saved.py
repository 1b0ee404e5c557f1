"""Saved plans: which operator decisions a plan records, and the decisions of every operator
rebuilt from them when the plan is applied to a trace of the step.

The search gives a choice only to the operators that decide their sharding; every other
operator follows the producer of its main operand (problem._group). A saved plan records the
deciding operators' strategies (plan_json.compact_decisions), and applying it walks the step's
units in order as the search does: a recorded operator takes its strategy, a follower derives
its own from its producer's result spec with `follow`. Nothing is priced and nothing searched:
each deciding unit has its one recorded strategy. A detailed plan (every operator in `ops`)
applies as recorded.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

from autopar.decisions import Decisions
from autopar.errors import AutoparError, collect_errors
from autopar.mesh import MeshShape
from autopar.plan import Decision, OpDecision, Plan, Repeat
from autopar.planning.problem import make_units
from autopar.rules import Spec, Strategy, enumerate_strategies, follow
from autopar.rules.factors import canonical
from autopar.rules.kinds import decides
from autopar.trace.analysis import layer_steps
from autopar.trace.ir import Op, OpGraph
from autopar.trace.layers import instance_of


def decisions_from_plan(graph: OpGraph, saved: Plan, shape: MeshShape) -> Decisions:
    """The decisions a saved plan records, checked against this trace of the step."""
    _check_mesh(saved, shape)
    problems = []
    by_path = {t.path: t for t in saved.inputs}
    inputs = []
    for t in graph.inputs:
        tensor = graph.tensors[t]
        entry = by_path.get(tensor.path or "")
        if entry is None or entry.shape != tensor.shape:
            problems.append(f"input {tensor.path} {tensor.shape} is not in the plan with that "
                            "shape; plan again for these arguments")
            continue
        inputs.append(entry.spec)
    count = len(saved.ops) if saved.ops else saved.search_stats.ops
    if count is not None and count != len(graph.ops):
        problems.append(f"the plan has {count} operators, this step traces to "
                        f"{len(graph.ops)}; plan again after changing the step")
    ops: list[Strategy] = []
    if saved.ops:
        ops = _recorded_ops(graph, saved.ops, shape, problems)
    elif not problems:
        ops = _rebuilt_ops(graph, saved.decisions, dict(zip(graph.inputs, inputs)), shape,
                           problems)
    layers = layer_steps(graph)
    problems += [f"the plan recomputes layer {name!r}, which this step does not have; plan again"
                 for name in saved.recompute if name not in layers]
    collect_errors(problems, f"the saved plan does not fit this step on mesh {shape}:")
    recompute = frozenset(i for name in saved.recompute for i in layers[name])
    return Decisions(inputs, ops, recompute,
                     pinned_inside=saved.search_stats.pinned_inside is not False)


def _check_mesh(saved: Plan, shape: MeshShape) -> None:
    """The plan's mesh is this one: the same axis names, each of the same size."""
    names = tuple(n for n, _ in saved.mesh)
    if names != shape.names:
        raise AutoparError(
            f"the saved plan splits over mesh axes {names}, and this mesh has axes "
            f"{shape.names} ({shape}). Fix: make the mesh with the plan's axis names, "
            f"autopar.make_mesh({dict(saved.mesh)}), or plan again for this mesh (leave out "
            "plan=).")
    if dict(saved.mesh) != shape.as_dict():
        raise AutoparError(f"the saved plan was made for mesh {dict(saved.mesh)}, and this mesh "
                           f"is {shape}. Fix: plan again for this mesh (leave out plan=), or "
                           "make the plan's mesh.")


def _strategy(graph: OpGraph, op: Op, d: Decision | OpDecision, shape: MeshShape,
              problems: list[str]) -> Strategy | None:
    """The recorded strategy of `op`, its specs padded to its operands' ranks; None, with a
    problem, where the record does not fit the operator (a hand-edited plan)."""
    tensors = [graph.tensors[t] for t in (*op.inputs, *op.outputs)]
    specs = (*d.in_specs, *d.out_specs)
    unknown = set(d.partial_axes) - set(shape.names)
    if (len(d.in_specs), len(d.out_specs)) != (len(op.inputs), len(op.outputs)) or unknown \
            or any(len(spec) > len(t.shape) for spec, t in zip(specs, tensors)):
        problems.append(f"the plan's strategy for operator {op.id} ({op.primitive} at "
                        f"{op.source}) does not fit its {len(op.inputs)} operands and "
                        f"{len(op.outputs)} results of shapes {[t.shape for t in tensors]} "
                        f"on mesh {shape}; plan again")
        return None
    padded = [spec + ((),) * (len(t.shape) - len(spec)) for spec, t in zip(specs, tensors)]
    used = {a for spec in padded for axes in spec for a in axes}
    return Strategy((), tuple(padded[:len(op.inputs)]), tuple(padded[len(op.inputs):]),
                    d.partial_axes, math.prod(shape.axis_size(a) for a in used))


def _recorded_ops(graph: OpGraph, recorded: Sequence[OpDecision], shape: MeshShape,
                  problems: list[str]) -> list[Strategy]:
    """Every operator's strategy as a detailed plan records it."""
    ops = []
    for op, d in zip(graph.ops, recorded):
        shapes = tuple(graph.tensors[t].shape for t in op.inputs)
        if d.primitive != op.primitive or d.in_shapes != shapes:
            problems.append(f"operator {op.id} is {op.primitive}{shapes} here but "
                            f"{d.primitive}{d.in_shapes} in the plan; plan again")
            break
        ops.append(_strategy(graph, op, d, shape, problems))
    return ops


def _deciding_by_op(graph: OpGraph, decided: Sequence[Decision | Repeat],
                    problems: list[str]) -> dict[int, Decision]:
    """op id -> its recorded decision, a Repeat's instances matched operator by operator with
    the deciding operators of the instance they repeat."""
    recorded: dict[int, Decision] = {}
    entries = [d for d in decided if isinstance(d, Decision)]
    for d in entries:
        if d.op >= len(graph.ops):
            problems.append(f"the plan records operator {d.op} ({d.primitive} in "
                            f"{d.scope or 'the step'}), which this step does not have; plan "
                            "again")
            continue
        op = graph.ops[d.op]
        shapes = tuple(graph.tensors[t].shape for t in op.inputs)
        if d.primitive != op.primitive or d.in_shapes != shapes:
            problems.append(f"operator {op.id} is {op.primitive}{shapes} here but "
                            f"{d.primitive}{d.in_shapes} in the plan; plan again")
            break
        recorded[d.op] = d
    deciding: dict[str | None, list] = defaultdict(list)
    for op in graph.ops:
        if decides(op.primitive, [graph.tensors[t].shape for t in op.inputs],
                   [graph.tensors[t].shape for t in op.outputs]):
            deciding[instance_of(op.scope)].append(op)
    for r in (d for d in decided if isinstance(d, Repeat)):
        pattern = [d for d in entries if instance_of(d.scope) == r.same_as]
        for inst in r.layers:
            here = deciding.get(inst, [])
            if len(here) != len(pattern) or any(
                    (op.primitive, op.backward, op.scope[len(inst):],
                     tuple(graph.tensors[t].shape for t in op.inputs))
                    != (d.primitive, d.backward, d.scope[len(r.same_as):], d.in_shapes)
                    for op, d in zip(here, pattern)):
                problems.append(f"the plan has layer {inst} decide as {r.same_as}, and this "
                                f"step's {inst} has other deciding operators ({len(here)} "
                                f"against {len(pattern)}); plan again")
                continue
            recorded.update({op.id: d for op, d in zip(here, pattern)})
    return recorded


def _rebuilt_ops(graph: OpGraph, decided: Sequence[Decision | Repeat],
                 input_specs: dict[int, Spec], shape: MeshShape,
                 problems: list[str]) -> list[Strategy]:
    """Every operator's strategy from a compact plan: the recorded ones as recorded, a
    follower's from its producer's result spec (follow), as problem._group derives it."""
    recorded = _deciding_by_op(graph, decided, problems)
    if problems:
        return []
    mesh = canonical(shape)
    units = make_units(graph, priced=False)
    producer = {t: (u, k) for u, unit in enumerate(units) for k, t in enumerate(unit.outputs)}
    made: list[tuple[Spec, ...]] = []  # unit -> the specs of its results
    ops: list[Strategy] = [None] * len(graph.ops)  # type: ignore[list-item]
    for u, unit in enumerate(units):
        if unit.op is None:
            made.append((input_specs[unit.outputs[0]],))
            continue
        d = recorded.get(unit.op.id)
        main = unit.main
        source = producer.get(unit.inputs[main]) if main is not None else None
        if d is not None:
            st = _strategy(graph, unit.op, d, shape, problems)
            if st is None:
                return []
        elif source is not None and source[0] < u:
            st = follow(unit.rule, mesh, main, made[source[0]][source[1]])
        else:  # decides, unrecorded: only an operator with one strategy may be
            options = enumerate_strategies(unit.rule, mesh)
            st = options[0]
            if len(options) > 1:
                problems.append(
                    f"operator {unit.op.id} ({unit.op.primitive} at {unit.op.source}) decides "
                    "its sharding in this step, and the plan records no decision for it; plan "
                    "again (a plan saved with detail=True records every operator)")
        ops[unit.op.id] = st
        made.append(st.out_specs)
    return ops
