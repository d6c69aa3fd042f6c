"""Recipe: flax NNX. Save ``nnx.split``'s state; restore into ``nnx.eval_shape`` and merge.

The restore target is abstract (``jax.ShapeDtypeStruct`` leaves), so the parameters are allocated
once, by the restore, never twice. The second half does the same for a model sharded over a
mesh of 8 devices (CPU devices here): every restored array lands on the mesh with the sharding
the model's annotations ask for.

    python examples/recipe_flax_nnx.py --url /tmp/nnx-ckpt
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import tempfile

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import casstore


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dhidden, rngs=rngs)
        self.norm = nnx.LayerNorm(dhidden, rngs=rngs)
        self.linear2 = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.norm(self.linear1(x))))


class ShardedMLP(nnx.Module):
    """The same MLP with partitioning annotations: hidden units split over the 'model' axis."""

    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.linear1 = nnx.Linear(din, dhidden, rngs=rngs,
                                  kernel_init=nnx.with_partitioning(init, (None, "model")),
                                  bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                                                  ("model",)))
        self.linear2 = nnx.Linear(dhidden, dout, rngs=rngs,
                                  kernel_init=nnx.with_partitioning(init, ("model", None)))

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def all_abstract(state) -> bool:
    """True if no leaf of ``state`` holds memory (the no-second-allocation check)."""
    return all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))


def plain(url: str) -> None:
    model = MLP(16, 32, 4, rngs=nnx.Rngs(0))
    _, state = nnx.split(model)
    casstore.save(url, 0, state, run="nnx")

    # Restore: an abstract model (no parameter memory), restore into its state, merge.
    abstract_model = nnx.eval_shape(lambda: MLP(16, 32, 4, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract_model)
    assert all_abstract(abstract_state)
    restored = nnx.merge(graphdef, casstore.restore(url, run="nnx", target=abstract_state))

    x = np.ones((2, 16), np.float32)
    np.testing.assert_array_equal(restored(x), model(x))
    print("nnx: restored into nnx.eval_shape + nnx.merge; outputs bit-identical")


def sharded(url: str) -> None:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    with jax.set_mesh(mesh):  # annotated variables are created sharded over the mesh
        model = ShardedMLP(16, 32, 4, rngs=nnx.Rngs(0))
    assert len(model.linear1.kernel[...].sharding.device_set) == 8
    casstore.save(url, 0, nnx.state(model), run="nnx-sharded")

    # Restore: an abstract model built under the mesh carries each leaf's PartitionSpec (on
    # the abstract mesh); the target names the concrete mesh's NamedSharding with that spec.
    with jax.set_mesh(mesh):
        abstract_model = nnx.eval_shape(lambda: ShardedMLP(16, 32, 4, rngs=nnx.Rngs(1)))
    graphdef, abstract_state = nnx.split(abstract_model)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec)), abstract_state)
    assert all_abstract(target)
    restored = nnx.merge(graphdef, casstore.restore(url, run="nnx-sharded", target=target))

    kernel = restored.linear1.kernel[...]
    assert kernel.sharding == NamedSharding(mesh, P(None, "model"))
    assert kernel.addressable_shards[0].data.shape == (16, 8)  # 32 hidden units over 4 devices
    np.testing.assert_array_equal(kernel, model.linear1.kernel[...])
    x = np.ones((2, 16), np.float32)
    np.testing.assert_array_equal(restored(x), model(x))
    print("nnx sharded: restored onto a 2x4 mesh of 8 devices; shardings and outputs match")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="checkpoint URL (default: a temp dir)")
    args = parser.parse_args()
    url = args.url or tempfile.mkdtemp(prefix="casstore-nnx-")
    plain(url)
    sharded(url)


if __name__ == "__main__":
    main()
