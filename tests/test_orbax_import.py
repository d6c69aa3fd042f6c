"""import_orbax: an orbax checkpoint, read by orbax, becomes a casstore step bit for bit."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import casstore


def make_tree():
    rng = np.random.default_rng(0)
    return {"params": {"w": jnp.asarray(rng.normal(size=(33, 17)), jnp.bfloat16),
                       "b": jnp.asarray(rng.normal(size=17), jnp.float32)},
            "opt": [np.arange(12, dtype=np.int8).reshape(3, 4),
                    np.array([np.nan, -0.0, np.inf], np.float16)],
            "step": 12, "lr": 0.25}


def assert_bit_exact(restored, tree):
    """Same structure; every leaf the same shape, dtype and bytes (NaN and -0.0 included).

    orbax stores Python scalars as int64 / float64, the dtype numpy gives them too."""
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(tree)):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert a.tobytes() == b.tobytes()


def test_standard_checkpointer_directory(tmp_path):
    tree = make_tree()
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "orbax", tree)
    url = str(tmp_path / "cas")
    info = casstore.import_orbax(tmp_path / "orbax", url, 12, run="imported")
    assert info.written_bytes > 0
    assert casstore.list_steps(url, run="imported") == [12]
    restored = casstore.restore(url, run="imported")
    assert_bit_exact(restored, tree)
    assert restored["params"]["w"].dtype == ml_dtypes.bfloat16
    assert int(restored["step"]) == 12
    assert float(restored["lr"]) == 0.25
    assert casstore.verify(url).ok


def test_checkpoint_manager_steps_with_named_items(tmp_path):
    tree = make_tree()
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        for step in (1, 2):
            tree["step"] = step
            mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree),
                extra=ocp.args.StandardSave({"seen": np.arange(step + 1)})))
        mngr.wait_until_finished()
    url = str(tmp_path / "cas")
    for step in (1, 2):
        casstore.import_orbax(tmp_path / "orbax" / str(step), url, step, item="state")
    assert casstore.list_steps(url) == [1, 2]
    assert_bit_exact(casstore.restore(url, 2), tree)
    # Step 2 shares every array with step 1: only the step scalar differs, and it is inline.
    manifests = [casstore.read_manifest(url, s) for s in (1, 2)]
    ids = [{ref.id for leaf in m.leaves for ref in leaf.chunks} for m in manifests]
    assert ids[0] == ids[1]
    assert ids[0]
    casstore.import_orbax(tmp_path / "orbax" / "2", url, 3)  # every item, under its name
    assert_bit_exact(casstore.restore(url, 3),
                     {"state": tree, "extra": {"seen": np.arange(3)}})


def test_a_steps_metrics_become_its_metrics_not_an_item(tmp_path):
    """orbax's manager writes save(metrics=) as an item "metrics": it was imported as state
    ({"default": ..., "metrics": ...}), and a restore into the state's target refused."""
    state = {"w": jnp.arange(6.0)}
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(tmp_path / "orbax", options=options) as mngr:
        for step, loss in ((1, 0.5), (2, 0.25), (3, 0.75)):
            mngr.save(step, args=ocp.args.StandardSave(state), metrics={"loss": loss})
        mngr.wait_until_finished()
    url = str(tmp_path / "cas")
    for step in (1, 2, 3):
        casstore.import_orbax(tmp_path / "orbax" / str(step), url, step,
                              metadata={"from": "orbax"} if step == 3 else None)
    abstract = jax.eval_shape(lambda: state)
    assert_bit_exact(casstore.restore(url, 2, target=abstract), state)
    casstore.import_orbax(tmp_path / "orbax" / "1", url, 4, target=abstract)  # one item
    with casstore.CheckpointManager(url, best_fn=lambda m: m["loss"], best_mode="min") as cas:
        assert cas.best_step() == 2
        assert cas.metadata(3) == {"from": "orbax"}
    assert casstore.read_manifest(url, 3).metadata == {"metrics": {"loss": 0.75},
                                                       "user": {"from": "orbax"}}
    assert jax.tree.structure(casstore.restore(url, 1)) == jax.tree.structure(state)


def test_every_item_of_a_step_is_imported_json_items_as_leaves(tmp_path):
    """A manager with item_names=("state", "extra"), StandardSave + JsonSave (issue 29)."""
    tree = make_tree()
    extra = {"epoch": 3, "names": ["a", "b"], "lr": 0.1, "done": False, "note": None,
             "nested": {"k": [1, 2.5]}}
    with ocp.CheckpointManager(tmp_path / "orbax", item_names=("state", "extra")) as mngr:
        mngr.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                             extra=ocp.args.JsonSave(extra)))
        mngr.wait_until_finished()
        orbax_restored = mngr.restore(5)
    assert orbax_restored.extra == extra
    url = str(tmp_path / "cas")
    casstore.import_orbax(tmp_path / "orbax" / "5", url, 5)
    restored = casstore.restore(url, 5)
    assert sorted(restored) == ["extra", "state"]
    assert_bit_exact(restored["state"], tree)
    assert restored["extra"] == extra  # the same Python values, types included
    assert [type(v) for v in jax.tree.leaves(restored["extra"])] == [
        type(v) for v in jax.tree.leaves(extra)]
    assert casstore.restore(url, 5, paths=["extra"])["extra"]["names"] == ["a", "b"]
    casstore.import_orbax(tmp_path / "orbax" / "5", url, 6, item="extra")
    assert casstore.restore(url, 6) == extra


def test_items_it_cannot_import_are_refused_by_name_and_nothing_is_written(tmp_path):
    tree = make_tree()
    with ocp.CheckpointManager(tmp_path / "orbax", item_names=("state", "arr")) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                             arr=ocp.args.ArraySave(np.ones(4))))
        mngr.wait_until_finished()
    url = str(tmp_path / "cas")
    with pytest.raises(casstore.UnsupportedItemError,
                       match=r"not 'arr' \(ArrayCheckpointHandler\); pass item= .*'state'") as e:
        casstore.import_orbax(tmp_path / "orbax" / "1", url, 1)
    assert e.value.items == {"arr": "ArrayCheckpointHandler"}
    assert isinstance(e.value, ValueError)
    with pytest.raises(casstore.UnsupportedItemError, match="'arr'"):
        casstore.import_orbax(tmp_path / "orbax" / "1", url, 1, item="arr")
    assert casstore.list_steps(url) == []
    casstore.import_orbax(tmp_path / "orbax" / "1", url, 1, item="state")
    assert_bit_exact(casstore.restore(url, 1), tree)


@pytest.mark.parametrize("name", ["../../elsewhere", "ABSOLUTE", "..", "a/b"])
def test_an_item_name_that_is_a_path_is_refused_and_nothing_outside_is_read(tmp_path, name):
    """Item names came from the step's metadata unchecked: '../x' or an absolute path read
    a directory outside the checkpoint into the repository (exploratory session's repro)."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "metadata").write_text(json.dumps({"api_key": "secret"}))
    step = tmp_path / "ckpt" / "10"
    step.mkdir(parents=True)
    name = str(tmp_path / "elsewhere") if name == "ABSOLUTE" else name
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps(
        {"item_handlers": {name: "orbax.checkpoint.JsonCheckpointHandler"}}))
    for item in (None, name):
        with pytest.raises(casstore.OrbaxReadError,
                           match=rf"{re.escape(repr(name))}, which is no item directory's"):
            casstore.import_orbax(step, tmp_path / "repo", 10, item=item)
    assert not (tmp_path / "repo").exists()


def test_single_item_is_found_and_missing_checkpoints_are_named(tmp_path):
    tree = make_tree()
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        mngr.save(7, args=ocp.args.StandardSave(tree))
    url = str(tmp_path / "cas")
    casstore.import_orbax(tmp_path / "orbax" / "7", url, 7)
    assert_bit_exact(casstore.restore(url, 7), tree)
    with pytest.raises(FileNotFoundError, match="not an orbax pytree checkpoint or item"):
        casstore.import_orbax(tmp_path / "orbax" / "7", url, 8, item="nope")
    with pytest.raises(FileNotFoundError, match="is not an orbax checkpoint"):
        casstore.import_orbax(tmp_path, url, 8)
    with pytest.raises(casstore.StepAlreadyExistsError, match=r"step already exists.*step 7\)"):
        casstore.import_orbax(tmp_path / "orbax" / "7", url, 7)


def test_the_parent_of_several_checkpoints_is_refused_naming_them(tmp_path):
    """It was imported as one step {"100": ..., "200": ..., "300": ...}."""
    with ocp.StandardCheckpointer() as ck:
        for step in (100, 200, 300):
            ck.save(tmp_path / "ckpts" / str(step), {"w": jnp.full(3, float(step))})
    url = str(tmp_path / "cas")
    with pytest.raises(FileNotFoundError,
                       match=r"ckpts' holds orbax checkpoints, not one: pass one of \['100', "):
        casstore.import_orbax(tmp_path / "ckpts", url, 300)
    assert casstore.list_steps(url) == []
    casstore.import_orbax(tmp_path / "ckpts" / "300", url, 300)
    assert casstore.restore(url, 300)["w"].tolist() == [300.0] * 3


def test_a_step_without_handler_metadata_refuses_items_of_unknown_kinds_by_name(tmp_path):
    """A step of an orbax that names no item handlers (its _CHECKPOINT_METADATA gone): the
    items neither a pytree's nor a JSON "metadata" file were dropped silently."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for name, save, restore, handler in (
            ("state", ocp.args.StandardSave, ocp.args.StandardRestore,
             ocp.StandardCheckpointHandler()),
            ("loader", ocp.args.JsonSave, ocp.args.JsonRestore,
             ocp.JsonCheckpointHandler(filename="loader.json"))):
        registry.add(name, save, handler)
        registry.add(name, restore, handler)
    with ocp.CheckpointManager(tmp_path / "orbax", handler_registry=registry) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": jnp.ones(3)}),
                                             loader=ocp.args.JsonSave({"position": 12})))
        mngr.wait_until_finished()
    step = tmp_path / "orbax" / "1"
    (step / "_CHECKPOINT_METADATA").unlink()
    url = str(tmp_path / "cas")
    with pytest.raises(casstore.UnsupportedItemError,
                       match=r"not 'loader' \(unknown handler\); pass item= .*'state'"):
        casstore.import_orbax(step, url, 1)
    assert casstore.list_steps(url) == []
    casstore.import_orbax(step, url, 1, item="state")
    assert casstore.restore(url, 1)["w"].tolist() == [1.0] * 3


def test_a_json_item_with_its_own_file_name_is_imported(tmp_path):
    """JsonCheckpointHandler(filename="extra.json"): its file is not 'metadata'."""
    with ocp.CheckpointManager(tmp_path / "orbax", item_names=("extra",), item_handlers={
            "extra": ocp.JsonCheckpointHandler(filename="extra.json")}) as mngr:
        mngr.save(1, args=ocp.args.Composite(extra=ocp.args.JsonSave({"epoch": 3})))
        mngr.wait_until_finished()
    url = str(tmp_path / "cas")
    casstore.import_orbax(tmp_path / "orbax" / "1", url, 1)
    assert casstore.restore(url, 1) == {"epoch": 3}  # one item: its tree


def test_int_dict_keys_and_prng_keys_come_back_through_the_target(tmp_path):
    """orbax keeps dict keys as strings and typed keys as key data; through target= they are
    the state's again, so a restore into its abstract tree (an nnx Optimizer's opt_state/0/...)
    fits."""
    state = {"opt": {0: jnp.arange(3.0), 1: {"mu": jnp.ones((2, 2), jnp.bfloat16)}},
             "rng": jax.random.key(7), "step": jnp.int32(4)}
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "orbax", state)
    url = str(tmp_path / "cas")
    abstract = jax.eval_shape(lambda: state)
    casstore.import_orbax(tmp_path / "orbax", url, 0)  # without target: orbax's own view
    with pytest.raises(casstore.TargetMismatchError, match=r"opt/\[=0\]"):
        casstore.restore(url, 0, target=abstract)
    casstore.import_orbax(tmp_path / "orbax", url, 1, target=abstract)
    back = casstore.restore(url, 1, target=abstract)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    assert jax.random.key_impl(back["rng"]) == jax.random.key_impl(state["rng"])
    assert np.asarray(jax.random.key_data(back["rng"])).tobytes() == np.asarray(
        jax.random.key_data(state["rng"])).tobytes()
    for a, b in zip(jax.tree.leaves(back["opt"]), jax.tree.leaves(state["opt"])):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        assert a.dtype == b.dtype


def test_a_target_of_narrower_dtypes_imports_the_saved_values_bit_exact(tmp_path):
    """``jax.eval_shape`` of a state with jax's x64 off says int32 / uint32 / float32 for its
    int64 / uint64 / float64 leaves: orbax's restore cast to them, and the import committed
    -1294967296 for 3000000000, 5 for 2**63 + 5 and inf for 1e300."""
    assert not jax.config.jax_enable_x64
    state = {"tokens_seen": np.array(3_000_000_000, np.int64), "seed": np.array([2**63 + 5],
             np.uint64), "ema": np.array([1e300, 1.0]), "w": jnp.ones(3, jnp.bfloat16),
             "keys": {0: np.int64(-2**62)}}
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "orbax", state)
    url = str(tmp_path / "cas")
    with np.errstate(over="ignore"):  # jax's own cast of 1e300 to float32, in eval_shape
        abstract = jax.eval_shape(lambda: state)
    assert abstract["tokens_seen"].dtype == np.int32
    casstore.import_orbax(tmp_path / "orbax", url, 0, target=abstract)
    assert_bit_exact(casstore.restore(url, 0), jax.tree.map(np.asarray, state))
    with pytest.raises(casstore.TargetMismatchError, match="overflow"):  # as for any step
        casstore.restore(url, 0, target=abstract)


def test_a_target_places_arrays_on_its_sharding_and_one_without_fits_any_machine(tmp_path):
    """A target without shardings (``jax.eval_shape``) of a checkpoint saved on a 4x2 mesh
    failed on a machine of one device (orbax: "Topology mismatch"); with shardings the
    arrays are restored onto them."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    sharding = NamedSharding(mesh, PartitionSpec("a", "b"))
    state = {"w": jax.device_put(jnp.arange(96.0).reshape(16, 6), sharding),
             "opt": {0: jnp.ones(2), 1: jnp.arange(4)}}
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "orbax", state)
    url = str(tmp_path / "cas")
    casstore.import_orbax(tmp_path / "orbax", url, 0, target=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    assert_bit_exact(casstore.restore(url, 0), jax.tree.map(np.asarray, state))
    (w,) = [leaf for leaf in casstore.read_manifest(url, 0).leaves if leaf.path == "w"]
    assert w.sharding == {"mesh": {"a": 4, "b": 2}, "spec": ["a", "b"]}  # imported onto it
    # on an AbstractMesh (nnx.eval_shape under jax.set_mesh): on the mesh jax.set_mesh made
    # active, as restore takes it (orbax: "_device_assignment is not implemented")
    with jax.set_mesh(mesh):
        casstore.import_orbax(tmp_path / "orbax", url, 2, target=jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
                mesh.abstract_mesh, x.sharding.spec) if x is state["w"] else None), state))
    assert_bit_exact(casstore.restore(url, 2), jax.tree.map(np.asarray, state))
    (w,) = [leaf for leaf in casstore.read_manifest(url, 2).leaves if leaf.path == "w"]
    assert w.sharding == {"mesh": {"a": 4, "b": 2}, "spec": ["a", "b"]}
    code = ("import jax, sys, casstore; assert len(jax.devices()) == 1\n"
            "t = {'w': jax.ShapeDtypeStruct((16, 6), 'float32'), 'opt': {\n"
            "     0: jax.ShapeDtypeStruct((2,), 'float32'),\n"
            "     1: jax.ShapeDtypeStruct((4,), 'int32')}}\n"
            "casstore.import_orbax(sys.argv[1], sys.argv[2], 1, target=t)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "orbax"), url], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_bit_exact(casstore.restore(url, 1), jax.tree.map(np.asarray, state))


@pytest.mark.parametrize("damage", ["_METADATA", "manifest.ocdbt", "_CHECKPOINT_METADATA"])
def test_a_damaged_orbax_checkpoint_is_named_and_nothing_is_written(tmp_path, damage):
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "orbax", make_tree())
    path = tmp_path / "orbax" / damage
    assert path.exists()
    path.write_text("{bad")
    url = str(tmp_path / "cas")
    with pytest.raises(casstore.OrbaxReadError,
                       match=f"{tmp_path / 'orbax'}.*nothing was written") as caught:
        casstore.import_orbax(tmp_path / "orbax", url, 0)
    assert casstore.list_steps(url) == []
    if damage == "_METADATA":  # the file is named (was orbax's AttributeError on None.tree)
        assert f"orbax reads no tree metadata there ('{path}'" in str(caught.value)
