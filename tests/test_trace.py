"""The tracer: paths, inlined calls, scan bodies, state pairs."""
import jax
import jax.numpy as jnp
import models

from autopar.trace.tracer import trace


def test_paths_and_state_pairs():
    step, state, batch = models.mlp_setup()
    graph, _, _ = trace(step, (state, batch))
    paths = [graph.tensors[t].path for t in graph.inputs]
    assert "state/0/params/Dense_0/kernel" in paths
    assert "batch/inputs" in paths
    out_paths = [graph.tensors[t].path for t in graph.outputs]
    assert "out/0/0/params/Dense_0/kernel" in out_paths
    # every state leaf pairs with its next value, the batch with nothing
    n_state = len(jax.tree_util.tree_leaves(state))
    assert sorted(graph.state_pairs.values()) == list(range(n_state))
    for k, i in graph.state_pairs.items():
        assert graph.tensors[graph.outputs[k]].shape == graph.tensors[graph.inputs[i]].shape


def test_calls_inlined_with_source_lines():
    @jax.jit
    def inner(x):
        return jnp.sin(x) @ x.T

    def fn(x):
        return inner(x).sum()

    graph, _, _ = trace(fn, (jnp.ones((4, 4)),))
    prims = [op.primitive for op in graph.ops]
    assert "jit" not in prims and "pjit" not in prims
    assert "dot_general" in prims and "sin" in prims
    assert any("test_trace.py" in op.source for op in graph.ops)


def test_scan_body_planned_once_with_repeat():
    def fn(x, ws):
        def body(c, w):
            return jnp.tanh(c @ w), c.sum()
        return jax.lax.scan(body, x, ws)

    graph, _, _ = trace(fn, (jnp.ones((8, 16)), jnp.ones((5, 16, 16))))
    dots = [op for op in graph.ops if op.primitive == "dot_general"]
    assert len(dots) == 1 and dots[0].repeat == 5
    prims = {op.primitive for op in graph.ops}
    assert {"scan_carry", "scan_slice", "scan_carry_out", "scan_stack"} <= prims
    assert [s.eqn.primitive.name for s in graph.program if s.eqn is not None] == ["scan"]
