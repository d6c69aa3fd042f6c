"""The systems a benchmark compares, behind one interface: casstore (``save`` / ``restore``, or
its ``CheckpointManager`` for asynchronous saves), orbax-checkpoint (``StandardCheckpointer``),
safetensors (one file per step, fsynced) and plain s3fs (one object per leaf); and the probes
of an S3 phase (requests by operation, a local server's CPU time, casstore's store calls)."""

from __future__ import annotations

import collections
import contextlib
import pathlib
import resource
from typing import Any

import jax
import numpy as np
import psutil

import casstore

from .states import flatten, host_array
from .storage import du, fsync_path

SAVE_INFO = ("written_bytes", "new_chunks", "reused_chunks", "delta_chunks",
             "delta_saved_bytes", "manifest_bytes")


class Peer(contextlib.AbstractContextManager):
    """A system saving steps of a state under ``root`` and restoring them. ``prepare(states)``
    (untimed) gives what ``save(step, state)`` takes; ``save`` returns once the step is durable
    (``save_async`` then ``wait`` where the system saves in the background); ``saved(step)``
    gives its figures, at least ``written_bytes``; ``restore(step, target)`` the state, ready:
    a pytree, or ``{name: array}`` where ``flat``, jax arrays where ``gives_jax``. ``dedups``:
    a save stores only what earlier steps lack."""

    gives_jax, flat, dedups = True, False, False

    def __init__(self, root: Any):
        self.root = root

    def prepare(self, states: list) -> list:
        return states

    def save(self, step: int, state: Any) -> None:
        self.save_async(step, state)
        self.wait()

    def wait(self) -> None:
        pass

    def stored_bytes(self) -> int:  # of everything stored so far
        return du(self.root)[1]

    def close(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        self.close()


class Casstore(Peer):
    """``casstore.save(url, step, state, **save_options)``, ``casstore.restore(url, step,
    target=target)``; ``url`` a path or a Store."""

    dedups = True

    def __init__(self, url: Any, **save_options: Any):
        super().__init__(url)
        self.url = str(url) if isinstance(url, pathlib.Path) else url
        self.options, self.info = save_options, None

    def save(self, step: int, state: Any) -> None:
        self.info = casstore.save(self.url, step, state, **self.options)

    def saved(self, step: int) -> dict:
        return {k: getattr(self.info, k) for k in SAVE_INFO}

    def restore(self, step: int, target: Any) -> Any:
        return jax.block_until_ready(casstore.restore(self.url, step, target=target))

    def stored_bytes(self) -> int:
        if isinstance(self.url, str):
            return du(pathlib.Path(self.url))[1]
        return sum(info.size for info in self.url.list(""))


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
    """``ocp.StandardCheckpointer`` (an ``AsyncCheckpointer``; it fsyncs its files), a step per
    directory ``root / step``, durable after ``wait_until_finished()``. It rewrites the whole
    state every step: a step's written bytes are its directory's size."""

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
    """``safetensors.numpy.save_file`` of the flattened state's host copies to ``root /
    f"{step}.safetensors"``, fsynced with its directory; restore is ``load_file`` (flat)."""

    gives_jax, flat = False, True

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
    """What a user without casstore does: every leaf an object ``root/step/name``, a step
    uploaded with one ``fs.pipe({path: array.tobytes()})``, read with one ``fs.cat([...])`` and
    ``np.frombuffer`` into the target's shapes (flat)."""

    gives_jax, flat = False, True

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


class RequestCounter:
    """Probe: the S3 API calls of an s3fs filesystem's client in a phase, by operation
    (``{name}_request_ops``) and in all (``{name}_requests``); a retried call counts once."""

    def __init__(self, fs: Any):
        fs.connect()  # creates the aiobotocore client, fs.s3
        self.counts: collections.Counter[str] = collections.Counter()
        fs.s3.meta.events.register("before-call.s3", self._count)

    def _count(self, model: Any, **_: Any) -> None:
        self.counts[model.name] += 1

    def start(self) -> None:
        self.counts = collections.Counter()

    def stop(self, out: dict, name: str) -> None:
        out[f"{name}_request_ops"] = dict(self.counts)
        out[f"{name}_requests"] = sum(self.counts.values())


class ServerCpu:
    """Probe: CPU seconds of this process's children in a phase: the servers it started
    (``{name}_server_cpu_s``; NaN with none, as with ``--endpoint``) and the programs that ran
    and exited meanwhile, such as rclone (``{name}_program_cpu_s``)."""

    @staticmethod
    def _cpu_s() -> tuple[float, float]:
        children = psutil.Process().children(recursive=True)
        total = 0.0 if children else float("nan")
        for child in children:
            with contextlib.suppress(psutil.Error):
                total += sum(child.cpu_times()[:2])
        exited = resource.getrusage(resource.RUSAGE_CHILDREN)
        return total, exited.ru_utime + exited.ru_stime

    def start(self) -> None:
        self.t0 = self._cpu_s()

    def stop(self, out: dict, name: str) -> None:
        (servers, programs), (s0, p0) = self._cpu_s(), self.t0
        out[f"{name}_server_cpu_s"] = servers - s0
        out[f"{name}_program_cpu_s"] = programs - p0


class StoreOps:
    """Probe: casstore's store calls in a phase (``{name}_store_ops``) from a CountingStore."""

    def __init__(self, store: Any):
        self.store = store

    def start(self) -> None:
        self.store.reset()

    def stop(self, out: dict, name: str) -> None:
        out[f"{name}_store_ops"] = dict(self.store.counts)
