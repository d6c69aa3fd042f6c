"""Recipe: a T5X-style train state, restored for inference as params only.

T5X keeps one train state: ``step``, ``params``, the optimizer state (adafactor's factored
moments) and ``flax_mutables`` (here BatchNorm statistics). Training saves all of it; inference
needs the parameters (and mutables) only. ``casstore.restore(url, target=..., partial=True)``
with a target of just those subtrees reads their chunks and no optimizer chunk at all: the
manifest says which chunks each key path needs, and only those are fetched. A
``casstore.store.CountingStore`` shows it.

    python examples/recipe_t5x.py --url /tmp/t5x-ckpt
"""

import argparse
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import casstore


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(64)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(64)(nn.gelu(x))


def init_state(key, tx):
    variables = Encoder().init(key, jnp.ones((2, 32)), train=False)
    return {"step": jnp.asarray(0, jnp.int32), "params": variables["params"],
            "param_states": tx.init(variables["params"]),
            "flax_mutables": {"batch_stats": variables["batch_stats"]}}


def train_step(state, tx, x):
    def loss_fn(params):
        y, updates = Encoder().apply({"params": params, **state["flax_mutables"]}, x,
                                     train=True, mutable=["batch_stats"])
        return jnp.mean(y ** 2), updates
    grads, mutables = jax.grad(loss_fn, has_aux=True)(state["params"])
    updates, opt = tx.update(grads, state["param_states"], state["params"])
    return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
            "param_states": opt, "flax_mutables": mutables}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="checkpoint URL (default: a temp dir)")
    args = parser.parse_args()
    url = args.url or tempfile.mkdtemp(prefix="casstore-t5x-")
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=32)
    x = np.linspace(-1, 1, 8 * 32, dtype=np.float32).reshape(8, 32)
    state = init_state(jax.random.key(0), tx)
    step = jax.jit(lambda s: train_step(s, tx, x))
    for _ in range(3):
        state = step(state)
    casstore.save(url, int(state["step"]), state, run="t5x")

    # Inference: params and mutables only, into an abstract target; optimizer state skipped.
    abstract = jax.eval_shape(lambda key: init_state(key, tx), jax.random.key(0))
    target = {"params": abstract["params"], "flax_mutables": abstract["flax_mutables"]}
    store = casstore.store.CountingStore(casstore.open_store(url))
    restored = casstore.restore(store, run="t5x", target=target, partial=True)

    manifest = casstore.read_manifest(url, run="t5x")
    def chunks_under(prefix):  # chunk ids of the leaves below a key path
        return {ref.id for leaf in manifest.leaves if leaf.path.startswith(prefix)
                for ref in leaf.chunks}
    optimizer, wanted = chunks_under("param_states/"), chunks_under("params/") | chunks_under(
        "flax_mutables/")
    # Chunk keys are chunks/<first 2 hex digits>/<the other 30> (format.md §2).
    read = {k.removeprefix("chunks/").replace("/", "") for k in store.keys_read
            if k.startswith("chunks/")}
    assert optimizer, (read, optimizer)
    assert not read & optimizer, (read, optimizer)
    assert read == wanted - optimizer, (read, optimizer)
    print(f"t5x: inference restore read {len(read)} chunks ({store.bytes_read} bytes incl. the "
          f"manifest); the checkpoint has {len(optimizer)} optimizer chunks, 0 of them read")

    y = Encoder().apply({"params": restored["params"], **restored["flax_mutables"]}, x,
                        train=False)
    y_live = Encoder().apply({"params": state["params"], **state["flax_mutables"]}, x,
                             train=False)
    np.testing.assert_array_equal(y, y_live)
    print("t5x: inference outputs bit-identical to the live train state's")


if __name__ == "__main__":
    main()
