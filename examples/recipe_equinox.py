"""Recipe: equinox modules with non-array fields.

An equinox module mixes arrays with fields that are not arrays (an activation function, ints,
a string). ``eqx.partition(model, eqx.is_array)`` keeps only the arrays for the checkpoint; the
rest is rebuilt by code. To restore, ``eqx.filter_eval_shape`` builds a skeleton whose array
leaves are ``jax.ShapeDtypeStruct`` (no parameter memory), it is partitioned on those leaves
(``eqx.is_array`` is False for them), the arrays are restored into its array half and
``eqx.combine`` puts the model back together.

    python examples/recipe_equinox.py --url /tmp/eqx-ckpt
"""

import argparse
import tempfile

import equinox as eqx
import jax
import numpy as np

import casstore


class Block(eqx.Module):
    linear: eqx.nn.Linear
    activation: callable  # a function: not an array, not saved
    name: str = eqx.field(static=True)
    depth: int = 2

    def __init__(self, size: int, name: str, key):
        self.linear = eqx.nn.Linear(size, size, key=key)
        self.activation = jax.nn.gelu
        self.name = name

    def __call__(self, x):
        for _ in range(self.depth):
            x = self.activation(self.linear(x))
        return x


class Model(eqx.Module):
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, size: int, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.blocks = [Block(size, "first", k1), Block(size, "second", k2)]
        self.head = eqx.nn.Linear(size, 1, key=k3)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def is_abstract_array(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="checkpoint URL (default: a temp dir)")
    args = parser.parse_args()
    url = args.url or tempfile.mkdtemp(prefix="casstore-eqx-")

    model = Model(8, jax.random.key(0))
    arrays, _ = eqx.partition(model, eqx.is_array)  # non-arrays become None
    info = casstore.save(url, 0, arrays, run="equinox")
    print(f"equinox: saved {len(jax.tree.leaves(arrays))} arrays, {info.written_bytes} bytes")

    # Restore: a skeleton without parameter memory, partitioned the same way. Its array leaves
    # are ShapeDtypeStructs, which eqx.is_array does not count as arrays: use is_abstract_array.
    skeleton = eqx.filter_eval_shape(Model, 8, jax.random.key(1))
    abstract_arrays, static = eqx.partition(skeleton, is_abstract_array)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract_arrays))
    restored = eqx.combine(casstore.restore(url, run="equinox", target=abstract_arrays), static)

    assert restored.blocks[1].name == "second"
    assert restored.blocks[0].activation is jax.nn.gelu
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    np.testing.assert_array_equal(restored(x), model(x))
    print("equinox: restored into eqx.filter_eval_shape's skeleton; non-array fields from code;"
          " outputs bit-identical")


if __name__ == "__main__":
    main()
