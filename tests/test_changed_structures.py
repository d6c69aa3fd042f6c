"""Restoring into a target whose structure changed: one error listing every difference,
``transforms`` renames, ``fill_missing`` (issue 14)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import casstore


@pytest.fixture
def saved(tmp_path):
    tree = {"layers": [{"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
                       {"w": np.ones((3, 3), np.float32)}],
            "head": {"w": np.full((3, 1), 2.0, np.float32)}, "step": 7}
    url = str(tmp_path / "ckpt")
    casstore.save(url, 1, tree)
    return url, tree


def abstract(tree):
    return jax.eval_shape(lambda: jax.tree.map(jnp.asarray, tree))


def test_one_error_lists_every_missing_extra_and_mismatched_path(saved):
    url, tree = saved
    target = abstract(tree)
    target["layers"][0]["w"] = jax.ShapeDtypeStruct((4, 3), jnp.float32)  # mismatched
    target["layers"][1]["b"] = jax.ShapeDtypeStruct((3,), jnp.float32)  # missing
    target["norm"] = {"scale": jax.ShapeDtypeStruct((3,), jnp.float32)}  # missing
    del target["head"]  # extra in the checkpoint
    with pytest.raises(casstore.TargetMismatchError,
                       match="2 missing, 1 extra, 1 mismatched") as info:
        casstore.restore(url, target=target)
    e = info.value
    assert set(e.missing) == {"layers/[1]/b", "norm/scale"}
    assert e.extra == ("head/w",)
    assert [p for p, _ in e.mismatched] == ["layers/[0]/w"]
    assert "(4, 3)" in e.mismatched[0][1]
    assert "(2, 3)" in e.mismatched[0][1]
    for path in ("layers/[1]/b", "norm/scale", "head/w", "layers/[0]/w"):
        assert repr(path) in str(e)
    assert "2 missing, 1 extra, 1 mismatched" in str(e)
    assert "partial=True" in str(e)
    assert e.key_path in {"layers/[1]/b", "norm/scale"}
    assert e.step == 1


def test_no_chunk_is_read_when_the_target_does_not_match(saved):
    url, tree = saved
    store = casstore.store.CountingStore(casstore.open_store(url))
    target = abstract(tree)
    target["extra"] = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(casstore.TargetMismatchError, match="missing 'extra'"):
        casstore.restore(store, target=target)
    assert not [k for k in store.keys_read if k.startswith("chunks/")]


def test_transforms_rename_saved_paths(saved):
    url, tree = saved
    target = {"blocks": {"0": {"kernel": abstract(tree["layers"][0]["w"])},
                         "1": {"kernel": abstract(tree["layers"][1]["w"])}},
              "head": {"kernel": abstract(tree["head"]["w"])}, "step": 0}
    with pytest.raises(casstore.TargetMismatchError, match="3 missing, 3 extra") as info:
        casstore.restore(url, target=target)
    assert len(info.value.missing) == 3
    assert len(info.value.extra) == 3
    r = casstore.restore(url, target=target, transforms={
        r"layers/\[(\d+)\]/w": r"blocks/\1/kernel", r"head/w": "head/kernel"})
    np.testing.assert_array_equal(r["blocks"]["0"]["kernel"], tree["layers"][0]["w"])
    np.testing.assert_array_equal(r["blocks"]["1"]["kernel"], tree["layers"][1]["w"])
    np.testing.assert_array_equal(r["head"]["kernel"], tree["head"]["w"])
    assert r["step"] == 7


def test_transforms_drop_saved_leaves_and_refuse_collisions(saved):
    url, tree = saved
    target = {"head": {"w": abstract(tree["head"]["w"])}, "step": 0}
    r = casstore.restore(url, target=target, transforms={r"layers/.*": None})
    np.testing.assert_array_equal(r["head"]["w"], tree["head"]["w"])
    with pytest.raises(casstore.TargetMismatchError, match="same key path"):
        casstore.restore(url, target=target, transforms={r"layers/\[\d+\]/w": "w"})


def test_renamed_leaf_that_stays_unmatched_is_reported_under_its_saved_path(saved):
    url, tree = saved
    target = abstract(tree)
    del target["head"]
    with pytest.raises(casstore.TargetMismatchError, match="renamed to 'out/w'") as info:
        casstore.restore(url, target=target, transforms={"head/w": "out/w"})
    assert info.value.extra == ("head/w",)
    assert "renamed to 'out/w'" in str(info.value)


def test_fill_missing_returns_concrete_target_leaves(saved):
    url, tree = saved
    target = abstract(tree)
    bias = jnp.full((3,), 0.5)
    target["layers"][1]["b"] = bias
    target["scale"] = np.float32(3.0)
    r = casstore.restore(url, target=target, fill_missing=True)
    assert r["layers"][1]["b"] is bias
    assert r["scale"] == np.float32(3.0)
    np.testing.assert_array_equal(r["layers"][1]["w"], tree["layers"][1]["w"])


def test_fill_missing_refuses_abstract_leaves_by_name(saved):
    url, tree = saved
    target = abstract(tree)
    target["layers"][1]["b"] = jax.ShapeDtypeStruct((3,), jnp.float32)
    with pytest.raises(casstore.TargetMismatchError, match="abstract") as info:
        casstore.restore(url, target=target, fill_missing=True)
    assert info.value.missing == ("layers/[1]/b",)
    assert "ShapeDtypeStruct" in str(info.value)
    assert "hint: fill_missing=True" not in str(info.value)  # passed already
    target["layers"][1]["b"] = jax.nn.relu  # an equinox module's function field, say
    with pytest.raises(casstore.TargetMismatchError, match=r"the target leaf \(\w+\) is no "
                       r"array or scalar: fill_missing needs a concrete array or scalar"):
        casstore.restore(url, target=target, fill_missing=True)


def test_transforms_need_a_target(saved):
    url, _ = saved
    with pytest.raises(ValueError, match="need a target"):
        casstore.restore(url, transforms={"a": "b"})


class TwoLayerMLP(nnx.Module):
    """The flax NNX checkpointing guide's model."""

    def __init__(self, dim, rngs: nnx.Rngs, use_bias=False):
        self.linear1 = nnx.Linear(dim, dim, rngs=rngs, use_bias=use_bias)
        self.linear2 = nnx.Linear(dim, dim, rngs=rngs, use_bias=use_bias)


def test_nnx_model_that_gained_a_bias(tmp_path):
    """The guide's seed case: the model gains biases after the checkpoint was written."""
    url = str(tmp_path / "ckpt")
    old = TwoLayerMLP(4, nnx.Rngs(0))
    casstore.save(url, 0, nnx.state(old))
    new_graph, new_state = nnx.split(nnx.eval_shape(lambda: TwoLayerMLP(4, nnx.Rngs(1),
                                                                          use_bias=True)))
    with pytest.raises(casstore.TargetMismatchError, match="missing 'linear1/bias/value'") as info:
        casstore.restore(url, target=new_state)
    assert set(info.value.missing) == {"linear1/bias/value", "linear2/bias/value"}
    with pytest.raises(casstore.TargetMismatchError, match="abstract"):
        casstore.restore(url, target=new_state, fill_missing=True)
    _, concrete = nnx.split(TwoLayerMLP(4, nnx.Rngs(1), use_bias=True))
    model = nnx.merge(new_graph, casstore.restore(url, target=concrete, fill_missing=True))
    np.testing.assert_array_equal(model.linear1.kernel[...], old.linear1.kernel[...])
    np.testing.assert_array_equal(model.linear1.bias[...], np.zeros(4, np.float32))


@pytest.mark.parametrize(("transforms", "message"), [
    ({"(": "x"}, r"transforms: '\(' is no regular expression: missing \)"),
    ({"a": 3}, r"transforms maps str regular expressions to str templates .* not 'a' to 3"),
    ({b"a": "x"}, r"not b'a' to 'x'")])
def test_transforms_that_are_no_regex_or_template_are_refused_naming_them(tmp_path, transforms,
                                                                          message):
    """They raised re.error, or a TypeError from inside re (exploratory session)."""
    casstore.save(tmp_path, 0, {"a": np.ones(2)})
    with pytest.raises(ValueError, match=message):
        casstore.restore(tmp_path, 0, target={"a": np.ones(2)}, transforms=transforms)
