"""The GPT-2-shaped train states benchmarks save, and the bit-exact checks of what comes back."""

import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import zstandard

from .timing import seconds

SIZES = {  # GPT-2 shapes: vocabulary, context, width, blocks
    "gpt2-xl": {"vocab": 50257, "ctx": 1024, "width": 1600, "blocks": 48},
    "gpt2": {"vocab": 50257, "ctx": 1024, "width": 768, "blocks": 12},
    "tiny": {"vocab": 1000, "ctx": 64, "width": 64, "blocks": 3},
}
JAX_SIZES = ("gpt2-xl",)  # made with jax.random on the device, not with numpy
CHANGED_BLOCKS = 2  # changed_state gives the last blocks new values
KINDS = ("params", "mu", "nu")


def _gpt2_tree(make: Callable[[tuple[int, ...]], Any], vocab: int, ctx: int, width: int,
               blocks: int) -> dict:
    """GPT-2's parameters (HF names), each leaf ``make(shape)``."""
    ln = lambda: {"g": make((width,)), "b": make((width,))}  # noqa: E731
    dense = lambda n, m: {"w": make((n, m)), "b": make((m,))}  # noqa: E731
    block = lambda: {"ln_1": ln(), "attn": {"c_attn": dense(width, 3 * width),  # noqa: E731
                                            "c_proj": dense(width, width)},
                     "ln_2": ln(), "mlp": {"c_fc": dense(width, 4 * width),
                                           "c_proj": dense(4 * width, width)}}
    return {"wte": make((vocab, width)), "wpe": make((ctx, width)),
            "h": [block() for _ in range(blocks)], "ln_f": ln()}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _jax_leaf(key: jax.Array, shape: tuple[int, ...], nu: bool) -> jax.Array:
    x = jax.random.normal(key, shape, jnp.float32)
    return jnp.abs(x) * jnp.float32(1e-3) if nu else x * jnp.float32(0.02)


def _fillers(seed: int, device: jax.Device | None) -> Callable[[str], Callable]:
    """``kind -> make(shape)``: float32 leaves, params and mu N(0, 0.02), nu |N(0, 1e-3)|; with
    numpy (one stream, in order), or with ``jax.random`` on ``device`` (one key per leaf)."""
    rng = np.random.default_rng(seed)

    def numpy_leaf(kind: str, shape: tuple[int, ...]) -> np.ndarray:
        out = rng.standard_normal(shape, dtype=np.float32)
        if kind == "nu":
            np.abs(out, out=out)
        out *= np.float32(1e-3 if kind == "nu" else 0.02)
        return out

    def jax_filler(kind: str) -> Callable:
        key = jax.random.fold_in(jax.random.key(seed), KINDS.index(kind))
        counter = itertools.count()

        def make(shape: tuple[int, ...]) -> jax.Array:
            with jax.default_device(device):
                return _jax_leaf(jax.random.fold_in(key, next(counter)), shape, kind == "nu")

        return make

    return jax_filler if device is not None else lambda kind: functools.partial(numpy_leaf, kind)


def train_state(size: str, seed: int = 0, device: jax.Device | None = None) -> dict:
    """Params, adam mu and nu (random, as mid-training) and the step count; sizes of
    :data:`JAX_SIZES` made on ``device`` (default: jax's default device), others with numpy."""
    fill = _fillers(seed, (device or jax.devices()[0]) if size in JAX_SIZES else None)
    shape = SIZES[size]
    return {"params": _gpt2_tree(fill("params"), **shape),
            "opt_state": {"count": np.int32(1000), "mu": _gpt2_tree(fill("mu"), **shape),
                          "nu": _gpt2_tree(fill("nu"), **shape)}}


def changed_state(state: dict, seed: int = 1) -> dict:
    """``state`` (not modified) with new values in the last blocks and ``ln_f`` of params, mu
    and nu, made as ``state``'s were, and count + 1; other leaves are ``state``'s objects."""
    wpe = state["params"]["wpe"]
    fill = _fillers(seed, next(iter(wpe.devices())) if isinstance(wpe, jax.Array) else None)
    blocks = len(state["params"]["h"])

    def renew(tree: dict, kind: str) -> dict:
        make = fill(kind)
        fresh = lambda x: make(x.shape)  # noqa: E731
        out = dict(tree, h=list(tree["h"]), ln_f=jax.tree.map(fresh, tree["ln_f"]))
        for i in range(max(0, blocks - CHANGED_BLOCKS), blocks):
            out["h"][i] = jax.tree.map(fresh, tree["h"][i])
        return out

    opt = state["opt_state"]
    return {"params": renew(state["params"], "params"),
            "opt_state": {"count": np.int32(opt["count"] + 1), "mu": renew(opt["mu"], "mu"),
                          "nu": renew(opt["nu"], "nu")}}


def two_states(size: str, dev: jax.Device | None = None) -> tuple[list, dict]:
    """A :func:`train_state` and its :func:`changed_state`, and a result's figures of them."""
    generate_s, first = seconds(lambda: train_state(size, device=dev))
    states = [first, jax.block_until_ready(changed_state(first))]
    n, raw, packed = changed_zstd_bytes(*states)
    return states, {"size": size, "shape": SIZES[size], "logical_bytes": state_bytes(first),
                    "leaves": len(jax.tree.leaves(first)), "changed_leaves": n,
                    "changed_raw_bytes": raw, "changed_zstd_bytes": packed,
                    "generate_s": generate_s}


def changed_zstd_bytes(old: dict, new: dict) -> tuple[int, int, int]:
    """(leaves that differ, their raw bytes, their zstd level-1 size) between two states."""
    level1, old_flat = zstandard.ZstdCompressor(level=1), flatten(old)
    count = raw = packed = 0
    for name, b in flatten(new).items():
        if not same_bytes(old_flat[name], b):
            data = np.ascontiguousarray(host_array(b)).tobytes()
            count, raw, packed = count + 1, raw + len(data), packed + len(level1.compress(data))
    return count, raw, packed


def state_bytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def device(name: str) -> jax.Device:
    """``"default"``: jax's default device (an accelerator where there is one); ``"cpu"``."""
    return jax.devices("cpu")[0] if name == "cpu" else jax.devices()[0]


def to_jax(states: list[Any], dev: jax.Device, copy: bool = False) -> list[Any]:
    """The states as jax arrays on ``dev``, a leaf shared by several states put once; with
    ``copy``, each in a fresh buffer (the caller may delete or donate it)."""
    cache: dict[int, jax.Array] = {}

    def put(x: Any) -> jax.Array:
        if id(x) not in cache:
            cache[id(x)] = jax.device_put(x, dev, may_alias=False if copy else None)
        return cache[id(x)]

    return jax.block_until_ready([jax.tree.map(put, s) for s in states])


def abstract_of(tree: Any, dev: jax.Device) -> Any:
    """A restore target: ``jax.ShapeDtypeStruct`` leaves on ``dev``."""
    sharding = jax.sharding.SingleDeviceSharding(dev)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                        tree)


def host_array(x: Any) -> np.ndarray:
    """A host copy of a leaf; of a jax array, through a temporary device copy (``np.asarray``
    would cache its host copy on the array for the array's lifetime)."""
    return np.asarray(x.copy() if isinstance(x, jax.Array) else x)


def flatten(tree: Any) -> dict[str, Any]:
    """``{"params/h/0/attn/c_attn/w": leaf}``: the key paths as safetensors tensor names."""
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(tree)}


def same_bytes(a: Any, b: Any) -> bool:
    """True if ``a`` and ``b`` have the same dtype, shape and bytes; compared on the
    accelerator where either is there, without a host copy."""
    if a is b:
        return True
    a, b = (x if hasattr(x, "dtype") else np.asarray(x) for x in (a, b))  # a Python scalar
    if np.dtype(a.dtype) != np.dtype(b.dtype) or np.shape(a) != np.shape(b):
        return False
    on_device = [x for x in (a, b) if isinstance(x, jax.Array)
                 and any(d.platform != "cpu" for d in x.devices())]
    if on_device:
        as_uint = np.dtype(f"u{np.dtype(a.dtype).itemsize}")
        x, y = (jax.device_put(v, next(iter(on_device[0].devices()))) for v in (a, b))
        return bool(jnp.array_equal(x.view(as_uint), y.view(as_uint)))
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def verify_equal(expected: Any, restored: Any, system: str, want_jax: bool = False) -> int:
    """The leaves checked; AssertionError unless ``restored`` (a tree, or flat) is ``expected``
    bit for bit (and jax arrays with ``want_jax``)."""
    want, restored = flatten(expected), flatten(restored)
    check(set(want) == set(restored), f"{system}: restored keys differ: "
          f"{sorted(set(want) ^ set(restored))[:5]}")
    for name, e in want.items():
        got = restored[name]
        check(not want_jax or isinstance(got, jax.Array),
              f"{system}: {name} restored as {type(got).__name__}")
        check(same_bytes(e, got), f"{system}: {name} differs from the saved state")
    return len(want)


def check(condition: bool, detail: Any) -> None:
    """Raises AssertionError with ``detail`` unless ``condition`` (also under ``python -O``)."""
    if not condition:
        raise AssertionError(str(detail))
