"""The liveness walk behind the memory estimate (autopar.cost.memory): every buffer a step
makes, from its first to its last time, as a platform's compiler (`BufferModel`) buffers it,
and the most bytes live at once."""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable

from autopar.cost.estimate import (KINDS, Buffer, MemoryEstimate, buffer_name, step_name,
                                   timeline_of)
from autopar.cost.last_reads import last_read, timed_last_reads
from autopar.cost.loop_bodies import body_collectives, body_peak, body_sum, converted_stacks
from autopar.cost.model import group_size, shard_bytes
from autopar.cost.xla.buffers import BufferModel
from autopar.mesh import MeshShape
from autopar.rules.factors import Spec
from autopar.trace.analysis import backward_steps, edges, per_graph, recomputed_layer_of
from autopar.trace.ir import OpGraph

def updated_in_place(graph: OpGraph, specs: dict[int, Spec]) -> set[int]:
    """The returned state that keeps its input's sharding: written into the donated input."""
    return {graph.outputs[o] for o, i in graph.donated_pairs.items()
            if specs.get(graph.outputs[o]) == specs.get(graph.inputs[i])}


def estimate(graph: OpGraph, specs: dict[int, Spec], mesh: MeshShape, model: BufferModel,
             reshards: dict[tuple[int, int], Spec] | None = None,
             recompute: Iterable[int] = (),
             all_reduces: dict[int, tuple[str, ...]] | None = None,
             in_loops: tuple[dict[tuple[int, int], Spec], dict[int, int]] = ({}, {})
             ) -> MemoryEstimate:
    """The per-device memory of running `graph` with tensors sharded as `specs` (as produced),
    operands resharded as `reshards` says (see operand_reshards), the forward steps in
    `recompute` recomputed for the backward pass, and the steps in `all_reduces` all-reducing
    their results (see all_reduce_steps), and the collectives inside loop bodies `in_loops`
    (see loop_body_collectives), as the compiler `model` buffers them."""
    walk = _Walk.start(graph, specs, mesh, reshards or {}, frozenset(recompute),
                       all_reduces or {}, model, in_loops)
    buffers = walk.values()
    buffers += walk.reshardings()
    buffers += walk.transposes()
    buffers += walk.loops()
    copies, slots = walk.copies()
    buffers += copies
    placed = (model.placed_in_donated([(b.first, b.last, b.nbytes) for b in buffers], slots)
              if slots else set())
    return walk.peak([b for n, b in enumerate(buffers) if n not in placed])


@dataclass
class _Walk:
    """One estimate's facts: the program's values and the times at which steps run."""

    graph: OpGraph
    specs: dict[int, Spec]
    mesh: MeshShape
    reshards: dict[tuple[int, int], Spec]
    model: BufferModel
    producer_step: dict[int, int]
    readers: dict[int, list[int]]
    kind: dict[int, str]
    materialised: frozenset[int]
    when: list[int]  # per program step, the time it runs at
    last: dict[int, int]  # per value, the last time it is needed
    begin: int  # the time of the first step, after the copies of donated inputs
    done: int  # the backward pass's last step
    in_backward: frozenset[int]
    backward: frozenset[int]  # the backward steps that recompute layers read (none without)
    early: frozenset[int]  # steps run first
    layer_at: dict[int, str]  # recomputed step -> its layer
    needed: dict[str, int]  # recomputed layer -> the time the backward pass first needs it
    aliased: set[int]
    copied: list[int]  # donated inputs copied before their update
    in_loops: tuple[dict[tuple[int, int], Spec], dict[int, int]]  # see loop_body_collectives
    transposed_from: dict[tuple[int, int], int] = field(default_factory=dict)
    ways: dict[Spec, int] = field(default_factory=dict)  # spec -> shards (see size)

    @classmethod
    def start(cls, graph: OpGraph, specs: dict[int, Spec], mesh: MeshShape,
              reshards: dict[tuple[int, int], Spec], recompute: frozenset[int],
              all_reduces: dict[int, tuple[str, ...]], model: BufferModel,
              in_loops: tuple[dict[tuple[int, int], Spec], dict[int, int]] = ({}, {})
              ) -> _Walk:
        program = graph.program
        producer_step, readers = edges(graph)
        materialised, into_sum, kind = model.values(graph)
        # A scatter into zeros for a sum alone scatters into the sum's other operand, unless
        # the sum reads it resharded: then it is a buffer of its own (made first where it
        # reads only inputs, as the loss's scatter of the labels does).
        materialised |= into_sum & {program[i].inputs[k] for i, k in reshards}
        # Times: program order, but the update of the state follows its inputs at once (see
        # schedule). XLA first copies the donated inputs it must copy (copied_before_update),
        # one after the other (times 0, 1, ...), then runs the steps that read only inputs
        # (early_steps); `last` is redone in those times.
        in_backward = backward_steps(graph)
        done = max(in_backward, default=len(program))
        groups = model.combined_all_reduces(graph, all_reduces)
        aliased = updated_in_place(graph, specs)
        copied = [t for t in model.copied_before_update(graph, aliased, groups)
                  if any(r <= done for r in readers[t])]
        begin = len(copied)
        layer_at = recomputed_layer_of(graph, recompute)
        # Recomputations (the plan's, and the user's: Equation.remat) wait for the backward pass.
        early = (model.early_steps(graph, done + 1) - layer_at.keys()
                 - {i for i, step in enumerate(program) if step.remat})
        order = model.schedule(graph, groups, done + 1) or range(len(program))
        when = [begin if i in early else begin + at for i, at in enumerate(order)]
        last = timed_last_reads(graph, model, tuple(when), frozenset(materialised), done)
        # A layer is recomputed when the backward pass first reads one of its results; it
        # reads its inputs from other layers then, so those live until that step.
        backward = in_backward if recompute else frozenset()
        needed: dict[str, int] = {}
        for i in sorted(backward):
            for t in program[i].inputs:
                layer = layer_at.get(producer_step.get(t, -1))
                if layer is not None:
                    needed.setdefault(layer, when[i])
        return cls(graph, specs, mesh, reshards, model, producer_step, readers, kind,
                   frozenset(materialised), when, last, begin, done, in_backward, backward,
                   frozenset(early), layer_at, needed, aliased, copied, in_loops)

    def size(self, t: int) -> int:
        """The bytes of `t` on one device (shard_bytes; asked for every buffer of a walk, so
        each spec's count of shards is worked out once)."""
        nbytes = self.whole_bytes[t]
        if not nbytes:
            return 0
        spec = self.specs.get(t)
        ways = 1 if spec is None else self.ways.get(spec)
        if ways is None:
            ways = self.ways[spec] = group_size(self.mesh, [a for axes in spec for a in axes])
        return int(nbytes / ways)

    @functools.cached_property
    def whole_bytes(self) -> list[int]:
        return _whole_bytes(self.graph)

    def last_read(self, steps: Iterable[int], default: int) -> int:
        return last_read(self.graph.program, self.materialised, self.last, steps, default,
                          self.when)

    def uses(self, t: int) -> set[int]:
        """The steps that need t: its readers and, through fused readers, theirs."""
        out: set[int] = set()
        stack = [t]
        while stack:
            for r in self.readers.get(stack.pop(), ()):
                if r not in out:  # fused values meet again downstream: walk each reader once
                    out.add(r)
                    stack += [o for o in self.graph.program[r].outputs
                              if o not in self.materialised]
        return out

    def values(self) -> list[Buffer]:
        """The buffers of the program's own values. A recomputed value read by the backward
        pass is two buffers: the forward pass's, and its recomputation's."""
        when, last, layer_at, needed = self.when, self.last, self.layer_at, self.needed
        whole_until = self._whole_until()
        producer_step, kinds, size = self.producer_step, self.kind, self.size
        # A value another recomputed layer reads lives until that layer is recomputed.
        read_again: dict[int, int] = {}
        for r, layer in layer_at.items():
            again = needed.get(layer, 0)
            for t in self.graph.program[r].inputs:
                if layer_at.get(producer_step.get(t, -1)) != layer and (
                        again > read_again.get(t, 0)):
                    read_again[t] = again
        out = []
        for t in self.materialised - set(self.graph.outputs):
            made = producer_step[t]
            start, kind = when[made], kinds.get(t, "temporaries")
            if not layer_at:  # nothing recomputed: each value lives to its last read
                out.append(Buffer(start, whole_until.get(t, last[t]), kind, size(t), t))
                continue
            own = layer_at.get(made)
            if own is not None:
                used = self.uses(t)
                bwd = [when[r] for r in used if r in self.backward]
                if bwd:
                    fwd = [when[r] for r in used if r not in self.backward]
                    out.append(Buffer(start, max(fwd + [start, read_again.get(t, 0)]), kind,
                                      self.size(t), t))
                    again = min(needed.get(own, min(bwd)), min(bwd))
                    out.append(Buffer(again, max(bwd), "temporaries", self.size(t), t,
                                      "recomputed"))
                    continue
            end = max(whole_until.get(t, last[t]), read_again.get(t, 0))
            out.append(Buffer(start, end, kind, self.size(t), t))
        return out

    @functools.cached_property
    def merged(self) -> dict[tuple[int, Spec], list[int]]:
        """(value, spec) -> the steps that read it so. XLA merges equal reshardings of one
        tensor (the lowering's constraints are equal) into one result."""
        out: dict[tuple[int, Spec], list[int]] = {}
        for (i, k), spec in self.reshards.items():
            out.setdefault((self.graph.program[i].inputs[k], spec), []).append(i)
        return out

    @functools.cached_property
    def resharding(self) -> dict[tuple[int, Spec], tuple[int, int]]:
        """(value, spec) -> (bytes its collectives make beside the result, the result)."""
        return {key: self.model.reshard_buffers(
                    self.graph.tensors[key[0]], self.specs.get(key[0]), key[1], self.mesh,
                    all(self._loop_fused(i) for i in steps))
                for key, steps in self.merged.items()}

    @functools.cached_property
    def slices(self) -> set[tuple[int, Spec]]:
        """The reshardings that only slice: no collective, no bigger result."""
        return {key for key, (gathered, result) in self.resharding.items()
                if gathered == 0 and result <= self.size(key[0])}

    def _loop_fused(self, i: int) -> bool:
        """Whether step i is a loop fusion, with the fused readers of its result: a loop
        fusion reads an operand in any layout; a reduction (XLA's CPU backend emits a sum of
        products as a library call) reads the default one."""
        program = self.graph.program
        chain = {i} | {r for o in program[i].outputs if o not in self.materialised
                       for r in self.uses(o)}
        return all(program[r].eqn is not None and self.model.fuses(program[r].eqn.primitive.name)
                   for r in chain)

    def _whole_until(self) -> dict[int, int]:
        """Sliced value -> the last time it is needed whole. XLA's scheduler runs a resharding
        that only slices as soon as the value is made, so the whole value is freed then unless
        other readers still need it whole."""
        program = self.graph.program
        sliced: dict[int, set[int]] = {}  # value -> the steps that read it sliced
        for t, spec in self.slices:
            sliced.setdefault(t, set()).update(self.merged[(t, spec)])
        out = {}
        for t in sliced.keys() & self.materialised - set(self.graph.outputs):
            # Not a recomputed value (see values), nor one made first (XLA slices those
            # where they are read).
            made = self.producer_step[t]
            if made in self.layer_at or made in self.early:
                continue
            whole = [r for r in self.readers[t] if r not in sliced[t] or any(
                u == t and (r, k) not in self.reshards for k, u in enumerate(program[r].inputs))]
            if len(whole) < len(self.readers[t]):
                out[t] = self.last_read(whole, self.when[made])
        return out

    def reshardings(self) -> list[Buffer]:
        """A resharding's result lives from the first step that reads it to the last (a weight
        gathered for the forward pass is kept for the backward pass), a slice from the value's
        making (see _whole_until); the gathered tensor it is sliced from, at the first. A
        forward value resharded for backward steps that transpose it (a weight gradient's
        convolution reads its activation so) is resharded and transposed as soon as it is
        made: the transposed copy lives from then, the resharded value only until it is
        transposed."""
        program, when = self.graph.program, self.when
        transposed = _transposed(self.graph, self.model)
        whole_until = self._whole_until()
        out = []
        for (t, spec), steps in self.merged.items():
            gathered, result = self.resharding[(t, spec)]
            operands = [(i, k) for i in steps for k, u in enumerate(program[i].inputs) if u == t]
            first, end, made = min(when[i] for i in steps), None, self.producer_step.get(t)
            if t in whole_until and (t, spec) in self.slices:
                first = when[made]
            elif (made is not None and made not in self.in_backward and made not in self.early
                  and all(i in self.in_backward for i in steps)
                  and all(p in transposed for p in operands)):
                first = end = when[made] + 1
                self.transposed_from.update(dict.fromkeys(operands, first))
            if end is None:
                end = self.last_read(steps, first)
            out.append(Buffer(first, end, "temporaries", result, t, "resharding", min(steps)))
            if gathered:
                out.append(Buffer(first, first, "temporaries", gathered, t, "resharding",
                                  min(steps)))
        return out

    def transposes(self) -> list[Buffer]:
        """Convolutions and dots whose dimension numbers are not the compiler's canonical ones
        get transposed copies of those operands (and a convolution's result), live at the
        step. The copy of an input, or of a value made from inputs alone, read unresharded is
        made with the steps that read only inputs; that of a resharded activation as
        reshardings says. Call after reshardings."""
        out = []
        for i, k, t in self.model.transposed_operands(self.graph):
            spec = self.reshards.get((i, k)) if k >= 0 else None
            nbytes = (self.size(t) if spec is None
                      else int(shard_bytes(self.graph.tensors[t], spec, self.mesh)))
            made = (self.begin if spec is None and k >= 0
                    and (t not in self.producer_step or self.producer_step[t] in self.early)
                    else self.transposed_from.get((i, k), self.when[i]))
            out.append(Buffer(made, self.when[i], "temporaries", nbytes, t, "transposing", i))
        return out

    def loops(self) -> list[Buffer]:
        """A loop's body runs inside its step: its values, the fused ones aside, held while
        the step runs. Counted without reuse, which bounds what the compiler keeps, unless
        the platform's compiler reuses buffers inside a body (loop_bodies.body_peak) (an
        accumulated gradient's loop is a whole forward and backward pass: see
        rewrite/accumulate.py). The loop's own marks are outside `ids`; those among them
        are an inner loop's, whose stacked results (a layer stack's residuals, one per
        layer, in a microbatch loop) are buffers of the body (docs/decisions.md, "Inner
        loops' results inside a microbatch loop"). Stacks the compiler converts whole before
        their loops (loop_bodies.converted_stacks) live from the start of the step."""
        graph, out = self.graph, []
        written, unwritten = self.model.body_buffers(graph, self.specs, self.mesh)
        fused = self.model.fused_values(graph) - written | unwritten
        if self.model.hoists_slice_converts:
            stacks, replaced = converted_stacks(
                graph, self.size, lambda x: self.producer_step.get(x, -1) in self.early | {-1})
            out = [Buffer(self.begin, max(self.when[i] for i in loops), "temporaries", nbytes,
                          x, "converted") for x, nbytes, loops in stacks]
            fused |= replaced
        def resharded(t: int, spec: Spec) -> tuple[int, int]:
            return self.model.reshard_buffers(graph.tensors[t], self.specs.get(t), spec, self.mesh)
        for i, ids in graph.loop_ops.items():
            nbytes = (body_peak(graph, ids, fused, self.size,
                                body_collectives(graph, ids, *self.in_loops, self.size, resharded),
                                self.model.defers_weight_gradients)
                      if self.model.reuses_in_loops else body_sum(graph, ids, fused, self.size))
            if nbytes:
                out.append(Buffer(self.when[i], self.when[i], "activations", nbytes,
                                  graph.program[i].outputs[0], "loop"))
        return out

    def copies(self) -> tuple[list[Buffer], list[tuple[int, int, int]]]:
        """A donated input is updated in place; the compiler copies it, first of all, for the
        readers of the old value not ordered before the update (the optimizer's steps read the
        original). Its allocation is then free until the update, for other buffers: the
        copies, and those free allocations as (bytes, first free time, last free time)."""
        graph = self.graph
        update_of = {graph.inputs[i]: self.producer_step[graph.outputs[o]]
                     for o, i in graph.donated_pairs.items()}
        out, slots = [], []
        for at, t in enumerate(self.copied):
            rs = [r for r in self.readers[t] if r <= self.done]
            out.append(Buffer(at, self.last_read(rs, at), "temporaries", self.size(t), t,
                              "copied"))
            slots.append((self.size(t), at + 1, self.when[update_of[t]] - 1))
        return out, slots

    def peak(self, buffers: list[Buffer]) -> MemoryEstimate:
        """The most bytes live at once, what is live then by kind, and its largest buffers."""
        graph = self.graph
        base: dict[str, int] = dict.fromkeys(KINDS, 0)
        for t in graph.inputs:
            base[self.kind[t]] += self.size(t)
        base["temporaries"] += sum(self.size(t) for t in set(graph.outputs)
                                   if t not in self.aliased)
        delta = [0] * (len(graph.program) + self.begin + 1)
        for b in buffers:
            delta[b.first] += b.nbytes
            delta[b.last + 1] -= b.nbytes
        delta[0] += sum(base.values())
        series = list(itertools.accumulate(delta[:-1]))  # the bytes live at each time
        peak, peak_time = sum(base.values()), -1
        if series and max(series) > peak:
            peak = max(series)
            peak_time = series.index(peak)  # the first time it is reached
        at_peak = dict(base)
        held = [Buffer(0, 0, self.kind[t], self.size(t), t, "input") for t in graph.inputs]
        for b in buffers:
            if b.first <= peak_time <= b.last:
                at_peak[b.kind] += b.nbytes
                held.append(b)
        held.sort(key=lambda b: -b.nbytes)
        then = self.when.index(peak_time) if peak_time in self.when else None
        where = (step_name(graph.program[then], then) if then is not None
                 else "the copies of donated inputs" if peak_time >= 0 else "the start of the step")
        return MemoryEstimate(int(peak), at_peak, where,
                              tuple((buffer_name(graph, self.producer_step, b), b.nbytes)
                                    for b in held[:5]),
                              timeline_of(series))


@per_graph  # read for every buffer of every estimate
def _whole_bytes(graph: OpGraph) -> list[int]:
    """Per tensor id, its bytes unsharded; 0 for a constant (folded into the program)."""
    return [0 if t.const else t.nbytes for t in graph.tensors]


@per_graph  # read by every estimate
def _transposed(graph: OpGraph, model: BufferModel) -> frozenset[tuple[int, int]]:
    """(step, operand) of each operand `model`'s compiler transposes into a copy for its step."""
    return frozenset((i, k) for i, k, _ in model.transposed_operands(graph))
