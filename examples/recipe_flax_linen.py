"""Recipe: flax linen with ``flax.training.train_state.TrainState``.

Saves the whole TrainState (step, params, optimizer state) every few steps with a
``casstore.CheckpointManager``, then restores the latest into an abstract TrainState built by
``jax.eval_shape`` and continues training from it bit for bit. ``apply_fn`` and ``tx`` are not
arrays: they are static fields of the TrainState dataclass, so they are part of the tree
structure, not leaves, and come back from the target.

    python examples/recipe_flax_linen.py --url /tmp/linen-ckpt
"""

import argparse
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import casstore


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(10)(x)


def create_state(rng) -> train_state.TrainState:
    model = CNN()
    params = model.init(rng, jnp.ones((1, 8, 8, 1)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adamw(1e-3))


@jax.jit
def train_step(state: train_state.TrainState, x, y) -> train_state.TrainState:
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="checkpoint URL (default: a temp dir)")
    args = parser.parse_args()
    url = args.url or tempfile.mkdtemp(prefix="casstore-linen-")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, 16)

    state = create_state(jax.random.key(0))
    with casstore.CheckpointManager(url, run="linen", max_to_keep=2) as mngr:
        for _ in range(6):
            state = train_step(state, x, y)
            step = int(state.step)
            if step % 2 == 0:
                mngr.save(step, state)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 6]

        # Restore into an abstract TrainState: same structure, ShapeDtypeStruct leaves.
        abstract = jax.eval_shape(create_state, jax.random.key(1))
        restored = mngr.restore(target=abstract)

    assert int(restored.step) == 6
    assert restored.apply_fn is not None
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)
    # Training continues identically from the restored state.
    np.testing.assert_array_equal(train_step(restored, x, y).params["Dense_0"]["kernel"],
                                  train_step(state, x, y).params["Dense_0"]["kernel"])
    print(f"linen: TrainState step {int(restored.step)} restored into jax.eval_shape(create_state);"
          " training resumes bit-identically")


if __name__ == "__main__":
    main()
