"""What a casstore repository's steps store by kind of leaf (params, adam ``mu`` and ``nu``):
their raw bytes, and the stored bytes of the chunk objects each step adds, its deltas and their
chains (storage_cost.py)."""

import collections
import math

import jax.numpy as jnp
import numpy as np

import casstore
from casstore._layout import chunk_key

from .states import KINDS


def kind_of(path: str) -> str:
    """``params``, ``mu`` or ``nu`` for a manifest key path (format.md §5), else ``other``."""
    parts = path.split("/")
    return "params" if parts[0] == "params" else next((k for k in ("mu", "nu") if k in parts),
                                                       "other")


def raw_bytes(url: str, step: int) -> dict[str, int]:
    """Raw bytes per kind and ``all`` of a step's leaves, from its manifest."""
    out = dict.fromkeys((*KINDS, "other", "all"), 0)
    for leaf in casstore.read_manifest(url, step).leaves:
        out[kind_of(leaf.path)] += leaf.nbytes
        out["all"] += leaf.nbytes
    return out


def attribute(url: str, steps: list[int]) -> list[dict]:
    """Per step: the stored bytes of the chunk objects it added by kind (shared among the blocks
    in an object by raw bytes), their count, deltas, longest delta chain and oldest base age."""
    first_step, base_of, out = {}, {}, []
    for step in steps:
        refs = [(kind_of(leaf.path), ref, math.prod(ref.shape) * jnp.dtype(leaf.dtype).itemsize)
                for leaf in casstore.read_manifest(url, step).leaves for ref in leaf.chunks]
        new = [(kind, ref, size) for kind, ref, size in refs if ref.key not in first_step]
        covered: collections.Counter = collections.Counter()
        for _, ref, size in new:
            covered[ref.key] += size
        fig = dict.fromkeys((*KINDS, "other"), 0.0)
        for kind, ref, size in new:
            fig[kind] += ref.stored_bytes * size / covered[ref.key]
        first_step.update(dict.fromkeys(covered, step))
        base_of.update({ref.id: ref.base for _, ref, _ in refs})

        def depth(cid: str) -> int:
            n = 0
            while base_of.get(cid) is not None:
                cid, n = base_of[cid], n + 1
            return n

        fig.update(chunk_bytes=sum(fig[k] for k in (*KINDS, "other")),
                   new_chunk_objects=len(covered),
                   delta_objects=len({ref.key for _, ref, _ in new if ref.base is not None}),
                   chain_depth=max((depth(ref.id) for _, ref, _ in refs), default=0),
                   base_age=max((step - first_step[chunk_key(ref.base)] for _, ref, _ in refs
                                 if ref.base is not None), default=0))
        out.append(fig)
    return out


def summary(per_step: list[dict], url: str | None, raw: dict[str, int]) -> dict:
    """A system's figures of its steps ``per_step`` (``save_s``, ``written_bytes``; with the
    repository ``url``, :func:`attribute`'s added to them): the mean save time and the written
    / raw bytes after the first step, in all and (with ``url``) per kind."""
    for fig, split in zip(per_step, attribute(url, range(len(per_step))) if url else ()):
        fig.update(split)
    later = per_step[1:]
    return {"per_step": per_step, "mean_save_s": np.mean([f["save_s"] for f in later]),
            "fraction": {k: sum(f[k if k != "all" else "written_bytes"] for f in later)
                         / (raw[k] * len(later)) for k in ("all", *(KINDS if url else ()))}}
