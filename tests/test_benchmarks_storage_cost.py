"""Smoke test: the storage-cost benchmark (deltas vs whole chunks vs orbax on a full fine-tune
and a pretraining-like run) runs end to end at small sizes, so it does not rot."""

import json
import math

import numpy as np

import casstore

from conftest import load_benchmark


def test_storage_cost_benchmark_reports_every_scenario_and_deltas_pay(tmp_path, capsys,
                                                                     monkeypatch):
    from casstore import _compression
    # Byte planes are the default codec where the cores encode faster than a local disk
    # writes (docs/tuning.md); below 4 cores "auto" stores raw chunks there.
    monkeypatch.setattr(_compression, "usable_cores", lambda: 8)
    bench = load_benchmark("storage_cost")
    out = tmp_path / "result.json"
    result = bench.main(["--tiny", "--no-warm", "--steps", "2", "--pretrain-steps", "2", "--dir",
                         str(tmp_path / "work"), "--json", str(out)])
    assert list((tmp_path / "work").iterdir()) == []  # every repository is removed
    assert result["codecs"] == "default"

    assert result["scenarios"] == list(bench.SCENARIOS)
    (ft,) = result["finetune"]  # --tiny: one learning rate
    pt = result["pretrain"]
    assert ft["lr"] == 1e-4
    assert ft["steps"] == 2
    assert pt["steps"] == 2
    assert ft["raw_bytes"]["params"] > 50e6  # --tiny: 13.7M, MiniLM's first layer
    assert ft["raw_bytes"]["mu"] == ft["raw_bytes"]["nu"] == ft["raw_bytes"]["params"]
    for figures in (ft, pt):
        systems = figures["systems"]
        assert set(systems) == set(bench.SYSTEMS)
        for name, fig in systems.items():
            assert [f["step"] for f in fig["per_step"]] == list(range(figures["steps"]))
            assert all(f["written_bytes"] > 0 for f in fig["per_step"]), name
            assert 0 < fig["fraction"]["all"] < 1.1, name
        for name in ("delta", "whole"):
            for f in systems[name]["per_step"][1:]:
                # The split by kind accounts for every new chunk object's bytes.
                assert math.isclose(f["chunk_bytes"], f["written_bytes"] - f["manifest_bytes"],
                                    rel_tol=1e-9, abs_tol=1e-3), (name, f)
                assert f["new_chunk_objects"] == f["new_chunks"]
                assert f["params"] > 0
                assert f["mu"] > 0
                assert f["nu"] > 0
            assert set(systems[name]["fraction"]) == {"all", *bench.h.KINDS}
        assert all(f["delta_chunks"] == 0 for f in systems["whole"]["per_step"])
        # Every tensor changes every step, and deltas make the steps after the first smaller.
        for d, w in zip(systems["delta"]["per_step"][1:], systems["whole"]["per_step"][1:]):
            assert d["delta_chunks"] > 0
            assert d["delta_objects"] > 0
            assert d["written_bytes"] < w["written_bytes"]
            assert d["written_bytes"] + d["delta_saved_bytes"] >= 0.9 * w["written_bytes"]
    for kind in ("params", "all"):
        assert ft["systems"]["delta"]["fraction"][kind] < ft["systems"]["whole"]["fraction"][kind]
    assert pt["changed_leaves_per_step"] == [pt["leaves"]] * pt["steps"]
    assert all(math.isfinite(loss) for loss in ft["losses"] + pt["losses"])

    for restore, figures in ((result["restore"], ft), (pt["restore"], pt)):
        for name, fig in restore["systems"].items():
            # The bit-exact checks ran (they raise inside the benchmark on a mismatch).
            assert fig["verified_leaves"] == figures["leaves"], name
            assert fig["warm_s"] > 0, name
        assert math.isnan(restore["systems"]["delta"]["cold_s"])  # no --drop-caches
        # Each restore is judged by the machine's limit, measured in the run.
        assert 0 < restore["limits"]["warm_s"] <= restore["limits"]["cold_s"]
    assert result["limit"]["decode_bps"] > 0
    assert ft["save_limit_s"] > pt["save_limit_s"] > 0
    assert result["restore"]["chain_depth"] >= 1  # the restored step's chunks are deltas
    assert result["restore"]["delta_objects"] > 0

    printed = capsys.readouterr().out
    assert printed.count("- target: casstore with deltas: all: ") == 1
    assert "| adam mu (54.8 MB raw) |" in printed
    assert "- target: warm: delta / whole: " in printed
    assert "save s per step (mean)" in printed
    assert "| ... limit / figure (limit " in printed
    assert json.loads(out.read_text())["finetune"][0]["systems"].keys() == set(bench.SYSTEMS)

    # --codecs no-shuffle stores raw chunks where the default stores byte planes, which store
    # adam's moments in fewer bytes, for whole chunks and deltas (the cheaper pretraining run).
    no_shuffle = bench.main(["--tiny", "--no-warm", "--pretrain-steps", "2", "--scenarios",
                             "pretrain", "--codecs", "no-shuffle", "--dir", str(tmp_path / "work")])
    assert no_shuffle["codecs"] == "no-shuffle"
    raw, planes = no_shuffle["pretrain"]["systems"], pt["systems"]
    for system in ("whole", "delta"):
        for kind in ("mu", "nu"):
            assert planes[system]["fraction"][kind] < 0.95 * raw[system]["fraction"][kind]


def test_new_chunk_bytes_are_attributed_to_the_leaves_holding_them(tmp_path):
    """Packed leaves share a chunk object: their shares add up to the objects on disk."""
    bench = load_benchmark("storage_cost")
    url = str(tmp_path / "repo")
    rng = np.random.default_rng(0)
    mu = rng.standard_normal(300_000, dtype=np.float32)  # the same in both steps

    def state(scale: float) -> dict:
        return {"params": {"w": rng.standard_normal(300_000, dtype=np.float32),
                           "b": np.full(1000, scale, np.float32)},
                "opt_state": [{"count": np.int32(1), "mu": {"w": mu,
                                                             "b": np.ones(1000, np.float32)},
                               "nu": {"w": np.ones(300_000, np.float32) * scale,
                                      "b": np.zeros(1000, np.float32)}}]}

    casstore.save(url, 0, state(1.0), delta=False)
    casstore.save(url, 1, state(2.0), delta=False)  # new params/w, params/b and nu/w
    store = casstore.open_store(url)
    on_disk = sum(info.size for info in store.list("chunks/"))
    step0, step1 = bench.training.attribute(url, [0, 1])
    assert math.isclose(step0["chunk_bytes"] + step1["chunk_bytes"], on_disk)
    assert step0["params"] > 0
    assert step0["mu"] > 0
    assert step0["nu"] > 0
    # mu/w is stored once; mu/b's share of the small leaves' pack (which changed) is new.
    assert step1["mu"] < 4000 < 8e5 < step0["mu"]  # mu/w: 1.2 MB raw, about 1.0 MB stored
    assert step1["params"] > 8e5
    assert step1["nu"] > 0
    assert step1["chain_depth"] == 0
    assert step1["delta_objects"] == 0
    raw = bench.training.raw_bytes(url, 1)
    assert raw["params"] == raw["mu"] == raw["nu"] == 1_204_000
    assert raw["other"] == 4
    paths = ("params/w", "opt_state/[0]/mu/b", "opt_state/[0]/nu/w", "opt_state/[0]/count", "step")
    assert [bench.training.kind_of(p) for p in paths] == ["params", "mu", "nu", "other", "other"]
