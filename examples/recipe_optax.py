"""Recipe: optax optimizer states, including frozen parts and the step counter.

An optax state is a pytree of NamedTuples (``ScaleByAdamState``, ``MultiTransformState``,
``MaskedState``, ``EmptyState``, ``MaskedNode`` for masked-out parameters...). casstore saves it
as it is; restore it into ``jax.eval_shape(tx.init, params)``, which has the same structure,
and training continues bit for bit. Frozen parameters (``optax.set_to_zero`` in a
``multi_transform``) have no optimizer moments, and the schedule's step counter (``count``) is
an ordinary int32 leaf.

    python examples/recipe_optax.py --url /tmp/optax-ckpt
"""

import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

import casstore


def make_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"encoder": {"w": jax.random.normal(k1, (8, 8)), "b": jnp.zeros(8)},
            "head": {"w": jax.random.normal(k2, (8, 2)), "b": jnp.zeros(2)},
            "embed": jax.random.normal(k3, (16, 8))}


def make_optimizer() -> optax.GradientTransformation:
    """Frozen encoder, adamw with a schedule on the head, and a masked weight decay on the
    embedding's rows (no decay on biases) through optax.masked."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20)
    labels = {"encoder": {"w": "frozen", "b": "frozen"}, "head": {"w": "train", "b": "train"},
              "embed": "embed"}
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.multi_transform({
            "frozen": optax.set_to_zero(),
            "train": optax.adamw(schedule),
            "embed": optax.chain(optax.masked(optax.add_decayed_weights(1e-4), lambda p: True),
                                 optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)),
        }, labels))


def loss(params, x):
    h = jnp.tanh(x @ params["encoder"]["w"] + params["encoder"]["b"] + params["embed"][:4].sum(0))
    return jnp.sum((h @ params["head"]["w"] + params["head"]["b"]) ** 2)


def train(params, opt_state, tx, x, steps):
    @jax.jit
    def step(params, opt_state):
        updates, opt_state = tx.update(jax.grad(loss)(params, x), opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return params, opt_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="checkpoint URL (default: a temp dir)")
    args = parser.parse_args()
    url = args.url or tempfile.mkdtemp(prefix="casstore-optax-")
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    tx = make_optimizer()
    params = make_params(jax.random.key(0))
    params, opt_state = train(params, tx.init(params), tx, x, 3)
    casstore.save(url, 3, {"params": params, "opt_state": opt_state}, run="optax")

    # Restore into the abstract state: same NamedTuples, ShapeDtypeStruct leaves.
    abstract_params = jax.eval_shape(make_params, jax.random.key(0))
    target = {"params": abstract_params, "opt_state": jax.eval_shape(tx.init, abstract_params)}
    restored = casstore.restore(url, run="optax", target=target)
    assert jax.tree.structure(restored) == jax.tree.structure({"params": params,
                                                               "opt_state": opt_state})
    counts = [x for p, x in jax.tree_util.tree_leaves_with_path(restored["opt_state"])
              if "count" in jax.tree_util.keystr(p)]
    assert counts
    assert all(int(c) == 3 for c in counts)

    # Frozen parameters have no optimizer moments in the checkpoint.
    manifest = casstore.read_manifest(url, 3, run="optax")
    moments = [leaf.path for leaf in manifest.leaves if "/mu/" in leaf.path]
    assert moments, moments
    assert not any("encoder" in p for p in moments), moments

    # Training continues identically from the restored state.
    ours = train(restored["params"], restored["opt_state"], tx, x, 2)
    live = train(params, opt_state, tx, x, 2)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(live)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ours[0]["encoder"]["w"], make_params(jax.random.key(0))
                                  ["encoder"]["w"])  # still frozen
    print(f"optax: {len(manifest.leaves)} leaves incl. {len(counts)} step counters; "
          "multi_transform/masked state restored into jax.eval_shape(tx.init); "
          "training resumes bit-identically")


if __name__ == "__main__":
    main()
