"""The systems a benchmark compares, behind one interface (:class:`Peer`); cold and warm
restores from each; the probes of an S3 phase."""

import collections
import contextlib
import math
import pathlib
import resource
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import psutil

import casstore

from . import limit
from .report import ratio
from .states import abstract_of, device, flatten, host_array, state_bytes, verify_equal
from .storage import du, fsync_path
from .timing import interleave, phase

SAVE_INFO = ("written_bytes", "new_chunks", "reused_chunks", "delta_chunks",
             "delta_saved_bytes", "manifest_bytes")


class Peer(contextlib.AbstractContextManager):
    """Saves steps of a state under ``root``: ``prepare(states)`` (untimed) gives what
    ``save(step, state)`` takes (``save_async`` then ``wait`` where it saves in the background);
    ``saved(step)`` its figures, at least ``written_bytes``; ``restore(step, target)`` jax
    arrays where ``gives_jax``, else ``{name: array}``. ``dedups``: stores only what is new."""

    gives_jax, dedups = True, False

    def __init__(self, root: Any):
        self.root = root

    def prepare(self, states: list) -> list:
        return states

    def save(self, step: int, state: Any) -> None:
        self.save_async(step, state)
        self.wait()

    def stored_bytes(self) -> int:  # of everything stored so far
        return du(self.root)[1]

    def close(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        self.close()


class Casstore(Peer):
    """``casstore.save(url, step, state, **options)`` and ``casstore.restore``; ``url`` a path
    or a Store."""

    dedups = True

    def __init__(self, url: Any, **options: Any):
        super().__init__(url)
        self.url, self.options, self.info = url, options, None

    def save(self, step: int, state: Any) -> None:
        self.info = casstore.save(self.url, step, state, **self.options)

    def saved(self, step: int) -> dict:
        return {k: getattr(self.info, k) for k in SAVE_INFO}

    def restore(self, step: int, target: Any) -> Any:
        return jax.block_until_ready(casstore.restore(self.url, step, target=target))


class CasstoreManager(Casstore):
    """casstore's ``CheckpointManager(root / "repo", enable_async_checkpointing=True)``."""

    save = Peer.save

    def __init__(self, root: pathlib.Path):
        super().__init__(root / "repo")
        self.mngr = casstore.CheckpointManager(self.url, enable_async_checkpointing=True)

    def save_async(self, step: int, state: Any) -> None:
        if not self.mngr.save(step, state):
            raise AssertionError(f"casstore did not save step {step}")

    def wait(self) -> None:
        self.mngr.wait_until_finished()
        self.info = self.mngr.last_save_info

    def restore(self, step: int, target: Any) -> Any:
        return jax.block_until_ready(self.mngr.restore(step, target=target))

    def close(self) -> None:
        self.mngr.close()


class Orbax(Peer):
    """``ocp.StandardCheckpointer`` (it fsyncs), a directory ``root / step`` per step, durable
    after ``wait_until_finished()``; it rewrites the whole state every step."""

    def __init__(self, root: pathlib.Path):
        import orbax.checkpoint as ocp

        super().__init__(root.absolute())
        self.ckptr = ocp.StandardCheckpointer()

    def save_async(self, step: int, state: Any) -> None:
        self.ckptr.save(self.root / str(step), state)

    def wait(self) -> None:
        self.ckptr.wait_until_finished()

    def saved(self, step: int) -> dict:
        return {"written_bytes": du(self.root / str(step))[1]}

    def restore(self, step: int, target: Any) -> Any:
        return jax.block_until_ready(self.ckptr.restore(self.root / str(step), target))

    def close(self) -> None:
        self.ckptr.close()


class Safetensors(Peer):
    """``safetensors.numpy.save_file`` of the flattened host copies to ``root /
    "{step}.safetensors"``, fsynced with its directory; restore is ``load_file``."""

    gives_jax = False

    def prepare(self, states: list) -> list:
        return [{k: host_array(v) for k, v in flatten(s).items()} for s in states]

    def save(self, step: int, tensors: dict) -> None:
        from safetensors.numpy import save_file

        save_file(tensors, str(self.root / f"{step}.safetensors"))
        fsync_path(self.root / f"{step}.safetensors")
        fsync_path(self.root)

    def saved(self, step: int) -> dict:
        return {"written_bytes": du(self.root / f"{step}.safetensors")[1]}

    def restore(self, step: int, target: Any) -> dict:
        from safetensors.numpy import load_file

        return load_file(str(self.root / f"{step}.safetensors"))


class S3fs(Peer):
    """Without casstore: every leaf an object ``root/step/name``, a step uploaded with one
    ``fs.pipe``, read with one ``fs.cat`` and ``np.frombuffer`` into the target's shapes."""

    gives_jax = False

    def __init__(self, fs: Any, root: str):
        super().__init__(root)
        self.fs, self.written = fs, {}

    def prepare(self, states: list) -> list:
        return [flatten(s) for s in states]

    def save(self, step: int, tensors: dict) -> None:
        objects = {f"{self.root}/{step}/{name}": np.ascontiguousarray(a).tobytes()
                   for name, a in tensors.items()}
        self.fs.pipe(objects)
        self.written[step] = sum(len(v) for v in objects.values())

    def saved(self, step: int) -> dict:
        return {"written_bytes": self.written[step]}

    def restore(self, step: int, target: Any) -> dict:
        shapes = {n: (tuple(t.shape), np.dtype(t.dtype)) for n, t in flatten(target).items()}
        got = self.fs.cat([f"{self.root}/{step}/{name}" for name in shapes])
        return {name: np.frombuffer(got[f"{self.root}/{step}/{name}"], dtype).reshape(shape)
                for name, (shape, dtype) in shapes.items()}

    def stored_bytes(self) -> int:
        self.fs.invalidate_cache()
        return sum(info["size"] for info in self.fs.find(self.root, detail=True).values())


def save_steps(peer: Peer, states: list, phase_: Callable, out: dict,
               steps: tuple = (2, 3)) -> None:
    """The changed save (``states[1]`` as ``steps[0]``) and the unchanged one (again as
    ``steps[1]``), timed by ``phase_(key, fn)``, with their :meth:`Peer.saved` figures."""
    for name, step in zip(("changed_save", "unchanged_save"), steps):
        phase_(f"{name}_s", lambda s=step: peer.save(s, states[1]))
        out.update({f"{name}_{k}": v for k, v in peer.saved(step).items()})


def cold_and_warm(peers: dict[str, Peer], ours: str, step: int, expected: Any, args: Any,
                  lim: dict, stored: int) -> dict:
    """Restores ``step`` into CPU jax arrays from each peer (rotating, ``args.repeat`` times),
    cold (with ``--drop-caches`` where permitted, else NaN and not run) then warm, each checked
    bit-exact: medians, ``ours``'s ratios to the others and the limits of a restore of
    ``stored`` bytes."""
    target, raw = abstract_of(expected, device("cpu")), state_bytes(expected)

    def one(system: str) -> dict:
        fig: dict = {"cold_s": math.nan, "cold_cpu_s": math.nan}
        for p in ("cold", "warm") if args.drop_caches else ("warm",):
            got = phase(fig, f"{p}_s", lambda: peers[system].restore(step, target),
                        warm=0 if args.no_warm else min(3 * raw, 8 << 30), drop=p == "cold")
            fig["verified_leaves"] = verify_equal(expected, got, system, True)
            del got
            if p == "cold" and not fig.pop("dropped_caches"):
                fig["cold_s"] = fig["cold_cpu_s"] = math.nan
        return fig

    runs, med, _ = interleave(tuple(peers), args.repeat, one)
    return {"step": step, "systems": med, "runs": runs,
            "dropped_caches": not math.isnan(med[ours]["cold_s"]),
            "ratios": {f"{p}_vs_{o}": ratio(med[ours][f"{p}_s"], med[o][f"{p}_s"])
                       for p in ("cold", "warm") for o in peers if o != ours},
            "limits": {f"{p}_s": limit.restore_s(lim, raw, stored, cold=p == "cold")
                       for p in ("cold", "warm")}}


def requests(fs: Any) -> Callable[[], dict]:
    """Probe: an s3fs filesystem's S3 API calls, by operation (``request_ops``) and in all
    (``requests``); a retried call counts once."""
    counts: collections.Counter[str] = collections.Counter()
    fs.connect()  # creates the aiobotocore client, fs.s3
    fs.s3.meta.events.register("before-call.s3", lambda model, **_: counts.update([model.name]))
    return lambda: {"request_ops": collections.Counter(counts), "requests": counts.total()}


def server_cpu() -> dict:
    """Probe: CPU seconds of this process's live children, the servers it started
    (``server_cpu_s``; NaN with none), and of those that exited, as rclone (``program_cpu_s``)."""
    children, total = psutil.Process().children(recursive=True), 0.0
    for child in children:
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    exited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"server_cpu_s": total if children else math.nan,
            "program_cpu_s": exited.ru_utime + exited.ru_stime}
