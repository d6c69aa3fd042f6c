"""Saves steps in a loop until killed; launched by test_crash.py.

Usage: crash_worker.py URL FIRST_STEP [STORAGE_OPTIONS_JSON]. Prints "ready" once imported.
       crash_worker.py --fork-server: the same for each JSON list ``[URL, FIRST_STEP,
       STORAGE_OPTIONS]`` read on stdin, in a child forked from this process (see
       :func:`fork_server`), which prints "ready PID".
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import traceback

import numpy as np

import casstore


def tree_for(step: int) -> dict:
    """Deterministic content per step, shared with the test that checks it."""
    rng = np.random.default_rng(step)
    weights = np.random.default_rng(0).standard_normal(200_000).astype(np.float32) * 0.02
    return {"base": np.arange(200_000, dtype=np.float32),
            "head": rng.standard_normal(300_000).astype(np.float32),
            "trained": weights * np.float32(1 + 1e-4 * (step % 997)),  # stored as deltas
            "small": np.full(50, step, np.int32), "step": step}


def save_until_killed(url: str, first: int, options: dict, ready: str = "ready") -> None:
    store = casstore.open_store(url, **options)
    save = casstore.save  # imported (with jax, 0.6 s) before "ready": kills land in saves
    print(ready, flush=True)
    for step in range(first, first + 1000):
        save(store, step, tree_for(step), chunk_size_bytes=64 * 1024)


def fork_server(child) -> None:
    """For each JSON list of arguments read on stdin, forks a child that runs
    ``child(*arguments, ready="ready PID")`` (it opens its store, prints that line and saves
    until it is killed), waits for the child, then prints "exited STATUS". The interpreter
    start and the imports of casstore and jax (1.5 s of CPU a trial on the loaded 2 cores)
    are paid once for all the kills of a campaign; each child starts from the same state, in
    which nothing was opened or saved and no thread runs. A child that raises prints its
    traceback on stderr and exits 1."""
    save = casstore.save  # noqa: F841 (jax imported before any fork)
    while line := sys.stdin.readline():
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                child(*json.loads(line), ready=f"ready {os.getpid()}")
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("exited", status, flush=True)


class ForkServer:
    """The test side of :func:`fork_server` run by ``worker`` (a script path), its stderr in
    the file ``errors``; :meth:`kill_during` replaces starting the worker for each kill."""

    def __init__(self, worker: str, errors):
        self.errors = errors
        with open(errors, "w") as err:
            self.proc = subprocess.Popen([sys.executable, worker, "--fork-server"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True)

    def kill_during(self, arguments: list, delay_s: float) -> None:
        """Starts a child on ``arguments``, SIGKILLs it ``delay_s`` after it said ready, and
        returns once it is reaped."""
        self.proc.stdin.write(json.dumps(arguments) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.close()
            raise AssertionError(f"{line!r}: {self.stderr()}")
        time.sleep(delay_s)
        os.kill(int(line.split()[1]), signal.SIGKILL)  # reaped only below: the pid is its own
        line = self.proc.stdout.readline()
        assert line.startswith("exited "), f"{line!r}: {self.stderr()}"

    def stderr(self) -> str:
        return pathlib.Path(self.errors).read_text()[-3000:]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        fork_server(save_until_killed)
    else:
        save_until_killed(sys.argv[1], int(sys.argv[2]),
                          json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
