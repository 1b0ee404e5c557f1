"""Two of Flax's examples, small, trained single-device and under autopar.

- MNIST (examples/mnist): an NNX CNN with Conv, BatchNorm, Dropout, avg_pool and Linear,
  optax SGD with momentum through nnx.Optimizer, and the example's metrics updated in the step.
  The example's `nnx.jit` step mutates its objects; here the objects are split into one state
  that goes through a pure `step(state, batch)` and comes back (nnx.split / nnx.merge), the
  form `autopar.auto_parallel` wraps.
- seq2seq (examples/seq2seq): the addition task's LSTM encoder-decoder in linen, nn.RNN over
  LSTM cells. Its training model is built with teacher_force=False: every decoder step feeds
  back a token drawn with jax.random.categorical from its own logits (one-hot), the lstm key
  folded with the step count as the example does.

Each trains 3 steps with jax.jit(step) and with autopar on {"data": 8} and
{"data": 2, "model": 4}: the losses must agree, the states too, and no primitive may lack a
rule (an AutoparWarning fails the test).
"""
from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import autopar
from helpers import copy_tree, global_relative_error

pytestmark = pytest.mark.slow  # the slow tier: `make test-fast` leaves it out

MESHES = {"8": {"data": 8}, "2x4": {"data": 2, "model": 4}}
STEPS = 3


def run(step, state, batches):
    """Train one step per batch from a copy of `state`: (final state, each step's outputs)."""
    state, outs = copy_tree(state), []
    for batch in batches:
        state, out = step(state, batch)
        outs.append(jax.tree_util.tree_map(np.asarray, out))
    return state, outs


@functools.cache
def example(name: str):
    """(setup, single-device run) of an example, built and run once for all meshes: the
    reference's compile is a third of each test's time."""
    setup = {"mnist": mnist_setup, "seq2seq": seq2seq_setup}[name]()
    step, state, batches = setup[0], setup[-2], setup[-1]
    return setup, run(jax.jit(step), state, batches)


def run_sharded(step, state, batches, mesh):
    """The same training under autopar; no operator may fall back to replication."""
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(mesh))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.AutoparWarning)
        return run(sharded, state, batches)


def initialise(create, abstract: bool = False):
    """`create()`'s arrays, computed under one jit with the original threefry (their shapes
    only, with `abstract`).

    Eagerly, each initialiser's operation compiles on its own; and XLA's CPU compiler takes
    seconds over the partitionable threefry's random bits (the default in jax 0.10), a
    fraction of a second over the original one. The parameters are as random either way;
    the steps themselves draw their dropout masks and samples with the default.
    """
    if abstract:
        return jax.eval_shape(create)
    with jax.threefry_partitionable(False):
        return jax.jit(create)()


def assert_same_training(ref_state, ref_losses, new_state, losses, state_tol=1e-4):
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    err = global_relative_error(ref_state, new_state)
    assert err < state_tol, f"state differs from the single-device run by {err:.2e}"


# -- MNIST (NNX) ---------------------------------------------------------------------------

class CNN(nnx.Module):
    """The example's CNN at a few channels: conv, batch norm, dropout, relu, 2x2 average
    pooling, twice; then two linear layers with dropout between them."""

    def __init__(self, channels: tuple[int, int] = (4, 8), hidden: int = 32, *,
                 rngs: nnx.Rngs):
        c1, c2 = channels
        self.conv1 = nnx.Conv(1, c1, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(c1, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(c1, c2, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(c2, rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(7 * 7 * c2, hidden, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def mnist_setup(batch: int = 16, steps: int = STEPS, learning_rate: float = 0.1,
                momentum: float = 0.9, seed: int = 0, abstract: bool = False):
    """(step, graphdef, state, batches): the example's training objects as one NNX state
    (its shapes alone with `abstract`, for tracing)."""
    def objects():
        model = CNN(rngs=nnx.Rngs(seed))
        optimizer = nnx.Optimizer(model, optax.sgd(learning_rate, momentum), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                  loss=nnx.metrics.Average("loss"))
        rngs = nnx.Rngs(seed)  # the dropout stream, passed to the model at call time
        model.train()
        return nnx.split((model, optimizer, metrics, rngs))

    graphdef, _ = nnx.eval_shape(objects)
    state = initialise(lambda: objects()[1], abstract)

    def loss_fn(model, batch, rngs):
        logits = model(batch["image"], rngs)
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits=logits, labels=batch["label"]).mean()
        return loss, logits

    def step(state, batch):
        model, optimizer, metrics, rngs = nnx.merge(graphdef, state)
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, batch, rngs)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)
        return nnx.state((model, optimizer, metrics, rngs)), loss

    rng = np.random.RandomState(seed)
    batches = [{"image": jnp.asarray(rng.uniform(0, 1, (batch, 28, 28, 1)), jnp.float32),
                "label": jnp.asarray(rng.randint(0, 10, (batch,)), jnp.int32)}
               for _ in range(steps)]
    return step, graphdef, state, batches


@pytest.mark.parametrize("mesh", list(MESHES))
def test_mnist_nnx(mesh):
    (step, graphdef, state, batches), (ref_state, ref_losses) = example("mnist")
    new_state, losses = run_sharded(step, state, batches, MESHES[mesh])
    assert_same_training(ref_state, ref_losses, new_state, losses)
    # The metrics the step accumulates: the loss averaged over the three steps, as sharded.
    ref_metrics = nnx.merge(graphdef, ref_state)[2].compute()
    metrics = nnx.merge(graphdef, new_state)[2].compute()
    np.testing.assert_allclose(float(ref_metrics["loss"]), np.mean(ref_losses), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["accuracy"]), float(ref_metrics["accuracy"]))


# -- seq2seq (linen) -----------------------------------------------------------------------

class AdditionTable:
    """The addition task's vocabulary: pad 0, eos 1, then '+', '0'-'9', '=' and ' '
    (sorted), one-hot encoded; queries 'a+b' and answers '=c', each ending in eos."""

    PAD, EOS = 0, 1

    def __init__(self, max_digits: int = 3):
        self.chars = sorted(set("0123456789+= "))
        self.ids = {c: i + 2 for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars) + 2
        self.max_digits = max_digits
        self.query_len = 2 * max_digits + 2  # digits, '+' and eos
        self.answer_len = max_digits + 3  # '=', one more digit than the terms, eos

    def encode(self, text: str, length: int) -> np.ndarray:
        tokens = [self.ids[c] for c in text] + [self.EOS]
        tokens += [self.PAD] * (length - len(tokens))
        return np.eye(self.vocab_size, dtype=np.float32)[tokens]

    def batch(self, rng: np.random.RandomState, size: int) -> dict[str, np.ndarray]:
        top = 10 ** self.max_digits - 1
        pairs = [sorted((rng.randint(0, 100), rng.randint(0, top + 1))) for _ in range(size)]
        return {"query": np.stack([self.encode(f"{a}+{b}", self.query_len) for a, b in pairs]),
                "answer": np.stack([self.encode(f"={a + b}", self.answer_len)
                                    for a, b in pairs])}


def mask_sequences(batch: jax.Array, lengths: jax.Array) -> jax.Array:
    """Zero the positions at or beyond each sequence's length."""
    return batch * (lengths[:, None] > jnp.arange(batch.shape[1])[None])


def sequence_lengths(one_hot: jax.Array, eos_id: int) -> jax.Array:
    """Each one-hot sequence's length with its eos; the full length when it has none."""
    eos = one_hot[:, :, eos_id]
    first = jnp.argmax(eos, axis=-1)
    return jnp.where(eos[jnp.arange(eos.shape[0]), first], first + 1, one_hot.shape[1])


class DecoderCell(nn.RNNCellBase):
    """One decoder step: an LSTM cell, logits over the vocabulary, and the next input drawn
    from them (categorical, one-hot) unless the true previous token is fed (teacher forcing)."""

    features: int
    teacher_force: bool
    vocab_size: int

    @nn.compact
    def __call__(self, carry, x):
        lstm_state, last_prediction = carry
        if not self.teacher_force:
            x = last_prediction
        lstm_state, y = nn.LSTMCell(self.features)(lstm_state, x)
        logits = nn.Dense(self.vocab_size)(y)
        token = jax.random.categorical(self.make_rng("lstm"), logits)
        prediction = jax.nn.one_hot(token, self.vocab_size, dtype=jnp.float32)
        return (lstm_state, prediction), (logits, prediction)

    @property
    def num_feature_axes(self) -> int:
        return 1


class Seq2seq(nn.Module):
    """LSTM encoder (stops at each query's eos: seq_lengths) and LSTM decoder started from
    the encoder's state and the answer's first token ('=')."""

    teacher_force: bool
    hidden_size: int
    vocab_size: int
    eos_id: int = AdditionTable.EOS

    @nn.compact
    def __call__(self, encoder_inputs, decoder_inputs):
        encoder = nn.RNN(nn.LSTMCell(self.hidden_size), return_carry=True, name="encoder")
        decoder = nn.RNN(DecoderCell(decoder_inputs.shape[-1], self.teacher_force,
                                     self.vocab_size),
                         split_rngs={"params": False, "lstm": True}, name="decoder")
        tokens = jnp.argmax(encoder_inputs, axis=-1)
        seq_lengths = jnp.argmax(tokens == self.eos_id, axis=-1)
        encoder_state, _ = encoder(encoder_inputs, seq_lengths=seq_lengths)
        return decoder(decoder_inputs[:, :-1], initial_carry=(encoder_state,
                                                              decoder_inputs[:, 0]))


def seq2seq_setup(batch: int = 16, hidden: int = 32, steps: int = STEPS,
                  teacher_force: bool = False, seed: int = 0, abstract: bool = False):
    """(step, state, batches) of the example's training loop (the state's shapes alone with
    `abstract`). The lstm key rides in the batch; the step folds the step count into it, so
    each step samples afresh."""
    table = AdditionTable()
    model = Seq2seq(teacher_force=teacher_force, hidden_size=hidden,
                    vocab_size=table.vocab_size)

    def create():
        k_params, k_lstm = jax.random.split(jax.random.key(seed))
        params = model.init({"params": k_params, "lstm": k_lstm},
                            jnp.ones((1, table.query_len, table.vocab_size)),
                            jnp.ones((1, table.answer_len, table.vocab_size)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adam(0.003))

    state = initialise(create, abstract)

    def cross_entropy(logits, labels, lengths):
        xe = jnp.sum(nn.log_softmax(logits) * labels, axis=-1)
        return -jnp.mean(mask_sequences(xe, lengths))

    def step(state, batch):
        labels = batch["answer"][:, 1:]
        lengths = sequence_lengths(labels, table.EOS)
        lstm_key = jax.random.fold_in(batch["lstm_rng"], state.step)

        def loss_fn(params):
            logits, _ = state.apply_fn({"params": params}, batch["query"], batch["answer"],
                                       rngs={"lstm": lstm_key})
            return cross_entropy(logits, labels, lengths), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        # The example's metrics: whole answers right, up to their eos.
        correct = jnp.argmax(logits, -1) == jnp.argmax(labels, -1)
        accuracy = jnp.mean(jnp.sum(mask_sequences(correct, lengths), axis=-1) == lengths)
        return state, (loss, accuracy)

    rng = np.random.RandomState(seed)
    batches = [{**jax.tree_util.tree_map(jnp.asarray, table.batch(rng, batch)),
                "lstm_rng": jax.random.key(seed + 1)} for _ in range(steps)]
    return step, state, batches


@pytest.mark.parametrize("mesh", list(MESHES))
def test_seq2seq(mesh):
    (step, state, batches), (ref_state, ref_outs) = example("seq2seq")
    new_state, outs = run_sharded(step, state, batches, MESHES[mesh])
    assert_same_training(ref_state, [l for l, _ in ref_outs], new_state, [l for l, _ in outs])
    np.testing.assert_array_equal([a for _, a in outs], [a for _, a in ref_outs])
    assert int(new_state.step) == STEPS
    # The decoder reads back its own samples: another lstm key, another loss (so the equal
    # losses above are equal draws, not a loss that ignores them).
    _, (other_loss, _) = jax.jit(step)(copy_tree(state),
                                       dict(batches[0], lstm_rng=jax.random.key(99)))
    assert abs(float(other_loss) - ref_outs[0][0]) > 1e-4
