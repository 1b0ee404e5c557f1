"""A Mixtral-style mixture-of-experts feed-forward layer with GShard-style dispatch.

Tokens are cut into groups of `group_size`; within a group every token picks its top-k
experts (softmax over those k logits gives the gate weights), and each expert takes at most
`capacity` tokens of the group, first choices before second ones. The dispatch and the
combine are one-hot einsums, so that under an 'exp' -> 'expert' rule with the groups split
over the batch axes the dispatch becomes an all-to-all.

Parameters are float32 and annotated with logical axis names; compute is bfloat16. The
activation constraints are flax logical constraints: no-ops outside a rules-and-mesh context.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

DTYPE = jnp.bfloat16  # compute
PARAM_DTYPE = jnp.float32


def capacity(group_size: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per group: its fair share of the group's choices times the factor."""
    return max(1, math.ceil(group_size * top_k * capacity_factor / experts))


def route(logits: jax.Array, top_k: int, cap: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-k routing within groups.

    logits: float32 [groups, group_size, experts], the router's.
    Returns (dispatch, combine, aux):
    - dispatch: float32 0/1 [G, S, E, C]: token s fills slot c of expert e. Every slot holds at
      most one token, every token at most `top_k` slots; a choice past its expert's `cap`
      slots is dropped (the residual connection carries that token).
    - combine: dispatch weighted by the token's gate weight for that expert.
    - aux: the load-balancing loss (Switch Transformer): E * sum_e f_e * p_e, f_e the fraction
      of first choices going to e and p_e its mean router probability; 1 when balanced.
    """
    groups, size, experts = logits.shape
    top_logits, top_index = jax.lax.top_k(logits, top_k)  # [G, S, k]
    weights = jax.nn.softmax(top_logits, axis=-1)
    choice = jax.nn.one_hot(top_index, experts, dtype=jnp.int32)  # [G, S, k, E]
    # Rank-major order, so that every first choice is served before any second choice.
    ranked = choice.transpose(0, 2, 1, 3).reshape(groups, top_k * size, experts)
    position = jnp.cumsum(ranked, axis=1) - 1  # the slot a choice would take at its expert
    position = position.reshape(groups, top_k, size, experts).transpose(0, 2, 1, 3)
    slot = jnp.sum(position * choice, axis=-1)  # [G, S, k]
    kept = (slot < cap).astype(jnp.float32)
    slot_hot = jax.nn.one_hot(slot, cap, dtype=jnp.float32)  # all zero past capacity
    choice_f = choice.astype(jnp.float32) * kept[..., None]
    dispatch = jnp.einsum("gske,gskc->gsec", choice_f, slot_hot)
    combine = jnp.einsum("gske,gskc,gsk->gsec", choice_f, slot_hot, weights)
    probs = jax.nn.softmax(logits, axis=-1)
    first = jnp.mean(choice[:, :, 0, :].astype(jnp.float32), axis=(0, 1))
    aux = experts * jnp.sum(first * jnp.mean(probs, axis=(0, 1)))
    return dispatch, combine, aux


def _expert_init(in_axis: int, out_axis: int) -> Any:
    """Fan-in scaled init of a stack of per-expert matrices (dimension 0: the experts)."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                            in_axis=in_axis, out_axis=out_axis, batch_axis=(0,))


class MoeMlp(nn.Module):
    """SwiGLU experts behind a top-k router: [batch, length, embed] -> (same, aux loss).

    Requires `length % min(group_size, length) == 0` (groups never straddle sequences).
    Expert kernels are [experts, embed, mlp] ('exp', 'embed', 'mlp') and [experts, mlp, embed].
    """
    experts: int
    top_k: int
    mlp: int
    group_size: int
    capacity_factor: float

    def _kernel(self, name: str, shape: tuple[int, ...], names: tuple) -> jax.Array:
        init = nn.with_logical_partitioning(_expert_init(1, 2), names)
        return self.param(name, init, shape, PARAM_DTYPE).astype(DTYPE)

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        batch, length, embed = x.shape
        size = min(self.group_size, length)
        if length % size:
            raise ValueError(f"length {length} is not a multiple of group size {size}")
        groups = x.reshape(batch * length // size, size, embed)
        groups = nn.with_logical_constraint(
            groups, ("activation_batch", "activation_length", "activation_embed"))
        gate_init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", None))
        gate = self.param("gate", gate_init, (embed, self.experts), PARAM_DTYPE)
        logits = jnp.einsum("gsm,me->gse", groups, gate.astype(DTYPE)).astype(jnp.float32)
        cap = capacity(size, self.experts, self.top_k, self.capacity_factor)
        dispatch, combine, aux = route(logits, self.top_k, cap)
        # Experts first: under expert parallelism this is where tokens cross devices.
        tokens = jnp.einsum("gsec,gsm->egcm", dispatch.astype(DTYPE), groups)
        per_expert = ("activation_exp", "activation_batch", None)
        tokens = nn.with_logical_constraint(tokens, (*per_expert, "activation_embed"))
        w0 = self._kernel("wi_0", (self.experts, embed, self.mlp), ("exp", "embed", "mlp"))
        w1 = self._kernel("wi_1", (self.experts, embed, self.mlp), ("exp", "embed", "mlp"))
        wo = self._kernel("wo", (self.experts, self.mlp, embed), ("exp", "mlp", "embed"))
        hidden = (nn.silu(jnp.einsum("egcm,emh->egch", tokens, w0))
                  * jnp.einsum("egcm,emh->egch", tokens, w1))
        hidden = nn.with_logical_constraint(hidden, (*per_expert, "activation_mlp"))
        out = jnp.einsum("egch,ehm->egcm", hidden, wo)
        out = nn.with_logical_constraint(out, (*per_expert, "activation_embed"))
        y = jnp.einsum("egcm,gsec->gsm", out, combine.astype(DTYPE))
        return y.reshape(batch, length, embed), aux
