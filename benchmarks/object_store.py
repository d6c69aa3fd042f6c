"""casstore vs plain s3fs on an S3 server: save and restore a GPT-2-small train state.

README.md's ``object_store.py`` section describes every figure."""

import collections
import functools
import pathlib
import sys
import uuid

import casstore
from casstore.store import CountingStore

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h

SYSTEMS = ("casstore", "s3fs")
FIGURES = [  # (key, label, unit); "n" is a count of S3 requests
    ("first_save_s", "1. first save", "s"),
    ("first_save_cpu_s", "1. ... CPU time of this process", "s"),
    ("first_save_server_cpu_s", "1. ... CPU time of the server", "s"),
    ("first_save_stored_bytes", "1. bytes stored after the first save", "B"),
    ("first_save_requests", "1. ... S3 requests", "n"),
    ("restore_s", "2. restore of step 1 (casstore: into jax arrays)", "s"),
    ("restore_cpu_s", "2. ... CPU time of this process", "s"),
    ("restore_server_cpu_s", "2. ... CPU time of the server", "s"),
    ("restore_requests", "2. ... S3 requests", "n"),
    ("restore_numpy_s", "2b. restore of step 1 into numpy arrays", "s"),
    ("changed_save_s", "3. second save, last 2 blocks + ln_f + count changed", "s"),
    ("changed_save_written_bytes", "3. ... bytes written", "B"),
    ("changed_save_requests", "3. ... S3 requests", "n"),
    ("unchanged_save_s", "4. save of the unchanged state", "s"),
    ("unchanged_save_written_bytes", "4. ... bytes written", "B"),
    ("unchanged_save_requests", "4. ... S3 requests", "n"),
    ("repo_bytes", "bytes stored after the 3 saves", "B"),
]
TARGETS = [  # (description, casstore / s3fs figure, limit)
    ("first save takes <= 1.0x plain s3fs's time", "first_save_s", 1.0),
    ("restore (into jax arrays) takes <= 1.0x plain s3fs's time", "restore_s", 1.0),
    ("bytes stored after the first save <= plain s3fs's", "first_save_stored_bytes", 1.0),
    ("frozen-part (second) save takes < 0.2x plain s3fs's time", "changed_save_s", 0.2),
]


def bench(system: str, options: dict, bucket: str, np_states: list, warm: int,
          drop: bool) -> dict:
    """``system``'s phases under a fresh prefix of ``bucket``, removed afterwards."""
    prefix = f"{bucket}/{'cas' if system == 'casstore' else 'plain'}-{uuid.uuid4().hex[:12]}"
    if system == "s3fs":
        fs = h.s3_fs(options, use_listings_cache=False)
        peer, probes = h.peers.S3fs(fs, prefix), []
        states = peer.prepare(np_states)
    else:
        store = CountingStore(casstore.open_store(f"s3://{prefix}", skip_instance_cache=True,
                                                  **options))
        peer, fs = h.peers.Casstore(store), store.inner.fs
        probes = [lambda: {"store_ops": collections.Counter(store.counts)}]
        states = h.to_jax(np_states, h.device("cpu"))
    stored, out = h.peers.S3fs(fs, prefix).stored_bytes, {}  # a fresh listing of the prefix
    phase = functools.partial(h.phase, out, warm=warm,
                              probes=[h.peers.requests(fs), *probes, h.peers.server_cpu])
    phase("first_save_s", lambda: peer.save(1, states[0]))
    out.update({f"first_save_{k}": v for k, v in peer.saved(1).items()})
    out["first_save_stored_bytes"] = stored()
    abstract = h.abstract_of(np_states[0], h.device("cpu"))
    for key, target in (("restore_s", abstract), ("restore_numpy_s", None)):
        if target is None and not peer.gives_jax:
            continue  # plain s3fs's only restore is into numpy
        got = phase(key, lambda t=target: peer.restore(1, t), drop=drop)
        out["verified_leaves"] = h.verify_equal(np_states[0], got, f"{system} {key}",
                                                peer.gives_jax and target is not None)
        del got
    h.peers.save_steps(peer, states, phase, out)
    out["repo_bytes"] = stored()
    fs.rm(prefix, recursive=True)
    return out


def run(args) -> dict:
    """Both systems ``args.repeat`` times (rotating), each on a server, as the limit."""
    np_states, result = h.two_states("tiny" if args.tiny else "gpt2")
    logical, changed_raw = result["logical_bytes"], result["changed_raw_bytes"]
    warm, buckets = 0 if args.no_warm else 3 * logical, []

    def on_server(fn):
        with h.s3_server(args) as options:
            buckets.append(h.new_bucket(options))
            return fn(options, buckets[-1])

    runs, res, lim = h.limit.interleaved(args, logical, SYSTEMS, lambda system, _: on_server(
        lambda o, b: bench(system, o, b, np_states, warm, args.drop_caches)),
        lambda: on_server(lambda o, b: h.limit.measure(logical, fs=h.s3_fs(o),
                                                       prefix=f"{b}/limit")))
    c = res["casstore"]
    restore = h.limit.restore_s(lim, logical, c["first_save_written_bytes"], cold=True)
    return {**result, "repeat": args.repeat, "results": res, "runs": runs, "limit": lim,
            "server": args.endpoint or "seaweedfs (weed mini) on 127.0.0.1, fresh per run",
            "drop_caches_requested": args.drop_caches, "buckets": buckets, "limits": {
                "first_save_s": h.limit.save_s(lim, logical, c["first_save_written_bytes"]),
                "changed_save_s": h.limit.save_s(lim, changed_raw, c["changed_save_written_bytes"]),
                "restore_s": restore, "restore_numpy_s": restore},
            "targets": [{"target": text, "ratio": h.ratio(c[key], res["s3fs"][key]),
                         "limit": limit} for text, key, limit in TARGETS]}


def table(result: dict) -> list[str]:
    """The medians with casstore / s3fs ratios and fractions of the limit, then notes."""
    c, p = result["results"]["casstore"], result["results"]["s3fs"]
    res = {"casstore": c, "s3fs": {**p, "restore_numpy_s": p["restore_s"]}}  # 2b: vs numpy
    lines = h.figure_table(res, FIGURES, list(SYSTEMS), "s3fs", result["limits"])
    lines += h.limit_lines(result["limit"], "The machine's limit on this S3 server, this run")
    lines += ["", f"- state: {result['logical_bytes'] / 1e6:.1f} MB in {result['leaves']} leaves "
              f"({result['size']}); the second save changes {result['changed_leaves']} leaves, "
              f"{result['changed_raw_bytes'] / 1e6:.1f} MB raw; plain s3fs's 2b column is its "
              f"only restore (numpy)"]
    ops = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"  # noqa: E731
    for name in ("first_save", "restore", "restore_numpy", "changed_save", "unchanged_save"):
        lines.append(f"- S3 requests, {name}: casstore {ops(c[f'{name}_request_ops'])}"
                     + (f"; plain s3fs {ops(p[f'{name}_request_ops'])}"
                        if f"{name}_request_ops" in p else "")
                     + f"; casstore store calls {ops(c[f'{name}_store_ops'])}")
    lines += h.target_lines([(t["target"], t["ratio"], t["limit"]) for t in result["targets"]])
    return [*lines, f"- median of {result['repeat']} run(s) per system; restores verified "
            f"bit-exact; server: {result['server']}; page cache dropped before restores: "
            f"{h.yes(result['drop_caches_requested'])}"]


main = h.command(__doc__, run, table, "repeat", "tiny", "dir", "drop-caches", "no-warm",
                 "endpoint", "key", "secret", "plot", plot_of=("casstore", "s3fs", "results"))

if __name__ == "__main__":
    main()
