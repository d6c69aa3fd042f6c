"""Starts the processes of a multi-process test job as children forked from one process that
has imported jax, numpy and casstore, instead of fresh interpreters: an interpreter start and
those imports take about 2.5 s of CPU a process on the 2-core machine, most of what a worker
of a multi-process job costs (test_multiprocess.py starts 30 of them).

Nothing in the server starts jax's backends, a thread or a connection: each child sets its
environment, then runs its script as ``python SCRIPT ARGS...`` would (``__main__``, its
directory first on ``sys.path``, unbuffered output to its file, stdin from /dev/null) and ends
as an interpreter does (non-daemon threads joined, atexit handlers run; an exception's
traceback printed, exit 1). Jobs whose environment differs from the server's in what jax or
casstore read at import (anything but ``XLA_FLAGS``, read when the backend starts, and
``CASSTORE_MULTIHOST_TIMEOUT_S``, read at each call) need a server started with it.

Protocol: each line on stdin is a JSON job ``{"processes": [[SCRIPT, ARG, ...], ...],
"outputs": [PATH, ...], "env": {...}, "timeout_s": S}``; the server forks every process of it,
waits for all (SIGKILL to those still running after ``timeout_s``), then prints their exit
codes as a JSON list (``-9`` for a killed one, as ``Popen.returncode``). With ``"start": true``
instead of a timeout it prints their pids at once, and ``{"wait": [PID, ...], "timeout_s": S,
"kill": BOOL}`` prints the codes of those, ``null`` for one still running after S seconds
(without ``kill``).
"""

import io
import json
import os
import signal
import subprocess
import sys
import time

PRELOADED = ("jax", "jax.sharding", "numpy", "casstore", "casstore.store")


def _child(argv: list[str], output: str, env: dict) -> None:
    """In the forked child: becomes ``python argv[0] argv[1:]`` writing to ``output``."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # PYTHONUNBUFFERED's streams: a line printed before os._exit is in the file.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                  line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  line_buffering=True, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    import runpy
    runpy.run_path(argv[0], run_name="__main__")


def _start(job: dict) -> list[int]:
    pids = []
    for argv, output in zip(job["processes"], job["outputs"]):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, output, job["env"])
            sys.exit(0)  # ends as the interpreter of the script would
        pids.append(pid)
    return pids


_reaped: dict[int, int] = {}  # exit codes of the children reaped: a pid is asked for again


def _wait(pids: list[int], timeout_s: float, kill: bool) -> list[int | None]:
    """The exit codes of ``pids``; None for one still running after ``timeout_s``, or with
    ``kill`` SIGKILL to those and their code, -9."""
    codes = _reaped
    deadline = time.monotonic() + timeout_s
    while not all(pid in codes for pid in pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if all(pid in codes for pid in pids):
            break
        if time.monotonic() > deadline:
            if not kill:
                break
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)
    return [codes.get(pid) for pid in pids]


def _serve_one(request: dict):
    if "wait" in request:
        return _wait(request["wait"], request["timeout_s"], request["kill"])
    pids = _start(request)
    return pids if request.get("start") else _wait(pids, request["timeout_s"], kill=True)


def serve() -> None:
    import importlib
    for name in PRELOADED:
        importlib.import_module(name)
    import casstore
    casstore.save, casstore.restore, casstore.CheckpointManager  # noqa: B018 (lazy imports)
    print("ready", flush=True)
    while line := sys.stdin.readline():
        print(json.dumps(_serve_one(json.loads(line))), flush=True)


class ForkServer:
    """The test side: a server process started with ``env``; :meth:`run` runs one job."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=self.env, text=True)
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"fork server: {line!r}, exit {self.proc.poll()}"

    def _ask(self, request: dict):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"fork server exited {self.proc.wait()}"
        return json.loads(line)

    def _job(self, processes, outputs, env) -> dict:
        return {"processes": [[str(a) for a in p] for p in processes],
                "outputs": [str(o) for o in outputs], "env": env or self.env}

    def run(self, processes: list[list[str]], outputs: list, env: dict | None = None,
            timeout_s: float = 120) -> list[tuple[int, str]]:
        """Runs ``processes`` (each ``[SCRIPT, ARG, ...]``) at once, their output (stdout and
        stderr) to the files ``outputs``; returns each one's ``(exit code, output)``."""
        job = self._job(processes, outputs, env)
        with_outputs = []
        for code, path in zip(self._ask({**job, "timeout_s": timeout_s}), job["outputs"]):
            with open(path, errors="backslashreplace") as f:
                with_outputs.append((code, f.read()))
        return with_outputs

    def start(self, processes: list[list[str]], outputs: list,
              env: dict | None = None) -> list[int]:
        """Starts ``processes`` as :meth:`run` does, without waiting: their pids (children of
        the server: :meth:`wait` for them)."""
        return self._ask({**self._job(processes, outputs, env), "start": True})

    def wait(self, pids: list[int], timeout_s: float, kill: bool = False) -> list[int | None]:
        """The exit codes of ``pids``, None for those still running after ``timeout_s``
        (with ``kill``: SIGKILLed then, -9)."""
        return self._ask({"wait": pids, "timeout_s": timeout_s, "kill": kill})

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def multihost_env(**extra: str) -> dict:
    """This process's environment for the processes of a ``jax.distributed`` job, with
    ``extra`` set: unbuffered output, and no ``XLA_FLAGS`` (each process one CPU device)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env.pop("XLA_FLAGS", None)
    return env


class LazyForkServer:
    """A :class:`ForkServer` started with ``env()`` at the first :meth:`run` (a test module
    keeps one, and closes it in a module-scoped fixture)."""

    def __init__(self, env):
        self.env, self.server = env, None

    def _server(self) -> ForkServer:
        if self.server is None:
            self.server = ForkServer(self.env())
        return self.server

    def run(self, *args, **kwargs) -> list[tuple[int, str]]:
        return self._server().run(*args, **kwargs)

    def start(self, *args, **kwargs) -> list[int]:
        return self._server().start(*args, **kwargs)

    def wait(self, *args, **kwargs) -> list[int | None]:
        return self._server().wait(*args, **kwargs)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


if __name__ == "__main__":
    serve()
