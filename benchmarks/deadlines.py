"""Time to failure of ``casstore.save`` on a misbehaving object store, per backend and fault.

README.md's ``deadlines.py`` section; docs/reliability.md has the figures."""

import argparse
import contextlib
import os
import pathlib
import socket
import sys
import tempfile
import time

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import numpy as np
import servers
from faultproxy import fault_proxy

import casstore

FAULTS = ("never answers", "stall", "trickle", "slowdown", "cut")


def time_to_failure(server, endpoint_url: str, timeouts: dict) -> str:
    """Seconds until one save through ``endpoint_url`` raises, as a table cell."""
    store = casstore.open_store(server.url_for("deadlines"), **{
        **server.storage_options, "endpoint_url": endpoint_url}, **timeouts)
    tree = {f"w{i}": np.random.default_rng(i).normal(size=65536).astype(np.float32)
            for i in range(16)}
    t0 = time.monotonic()
    try:
        casstore.save(store, 1, tree, chunk_size_bytes=1 << 18)
    except casstore.StoreTimeoutError:
        return f"{time.monotonic() - t0:.1f}"
    except Exception as e:  # reported, not hidden: the table says what happened
        return f"{time.monotonic() - t0:.1f} ({type(e).__name__})"
    return f"saved in {time.monotonic() - t0:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("request_timeout_s", "operation_timeout_s"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, dest=name)
    timeouts = {k: v for k, v in vars(parser.parse_args()).items() if v}
    print(f"timeouts: {timeouts or 'defaults'}")
    print("machine's limit: none applies (benchmarks/README.md, deadlines.py): these are times "
          "to fail on a stalled or refusing endpoint, set by the deadlines, not by a machine's "
          "rate\n")
    print("| backend | " + " | ".join(FAULTS) + " |\n|---|" + "---|" * len(FAULTS))
    with contextlib.ExitStack() as stack:
        tmp = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
        backends = {"S3 (SeaweedFS)": stack.enter_context(servers.seaweedfs_server(tmp)),
                    "GCS (fake-gcs-server)": stack.enter_context(servers.fake_gcs_server(tmp))}
        for name, server in backends.items():
            with socket.socket() as listener:  # accepts connections, never answers
                listener.bind(("127.0.0.1", 0))
                listener.listen(256)
                cells = [time_to_failure(server, f"http://127.0.0.1:{listener.getsockname()[1]}",
                                         timeouts)]
            for fault in FAULTS[1:]:
                with fault_proxy(server.endpoint_url) as proxy:
                    proxy.set(fault)
                    cells.append(time_to_failure(server, proxy.endpoint_url, timeouts))
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
