"""Review of the manager's Prometheus metrics and `cachectl status` against a real cachemanager,
a real cacheserver and a job driven through its calls (register, batch reports, a chunk loaded and
released, an autocache report, the server leaving, a kill -9 and restart on the same state dir).

1. A numbered batch report sent again (its reply was lost) is applied once, and was only logged:
   it is counted now, `mlcache_manager_events_total{name="batch_reports_repeated"}`.
2. The state counted `autocache_decisions` (model.py) but no metric exported it.
3. The JSON fields of `cachectl status` and the meaning of the process counters were undocumented
   (docs/manager.md, Operations).
Checked as well: gauges agree with Status, decision counters do not go back after a restart, no
label grows with jobs, datasets or servers."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from manager.manager_client import ManagerClient, NumberedBatches, new_report_stream
from manager.metrics import DECISION_COUNTERS
from procs import ROOT, cachemanager, cacheserver, free_port, wait_ring, wait_until
from test_policy_autocache import costs

DS = "ab" * 32
N = 100
FLAGS = ("--chunks", "--bypass-probes", "--budget", "300kB", "--chunk-size", "100kB", "--heartbeat-misses", "2")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of the manager's /metrics: (name, sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def event(r: dict, name: str) -> float | None:
    return r.get(("mlcache_manager_events_total", (("name", name),)))


def gauge(r: dict, name: str) -> float:
    return r[(f"mlcache_manager_{name}", ())]


def status(address: str) -> dict:
    with ManagerClient(address, timeout=5) as mc:
        return mc.status_dict(wait=True)


def steady(port: int, address: str) -> tuple[dict, dict]:
    """A scrape and a Status of the same state: the decision loop may change it between two reads,
    so read until the scrapes before and after the Status agree."""
    def once():
        a, st, b = scrape(port), status(address), scrape(port)
        keys = [k for k in a if k[0] != "mlcache_manager_events_total"]
        return (b, st) if all(a[k] == b.get(k) for k in keys) else None
    return wait_until(once, "a scrape and a Status of one state", timeout=20)


def batches(n: int) -> tuple:
    now = time.time()
    return tuple((now - (n - i) * 0.05, 0.05, 0.5) for i in range(n))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The scenario, once: what was scraped and seen at each step."""
    root = tmp_path_factory.mktemp("metrics")
    port, mport = free_port(), free_port()
    state = str(root / "mgr")
    m = cachemanager(state, port, *FLAGS, "--metrics-port", str(mport)).start()
    srv = cacheserver(str(root / "srv"), "64MB", 0, "--manager", m.address, "--data-listen", "127.0.0.1:0").start()
    out: dict = {"mport": mport}
    try:
        wait_ring(m.address, 1)
        with ManagerClient(m.address, timeout=5) as mc:
            mc.register_job("job-a", DS, 1_000_000, N)
            mc.register_job("job-b", DS, 1_000_000, N)
            stream = new_report_stream()
            first = NumberedBatches(stream, 1, batches(5))
            for _ in range(3):  # sent twice again: its reply "lost"
                mc.report_batches("job-a", first)
            mc.report_batches("job-a", NumberedBatches(stream, 2, batches(4)))
            mc.report_loaded(DS, 0, 1.0)
            mc.release_chunk("job-a", DS, 0)
            mc.report_pipeline("job-a", DS, "5e" * 32, costs(items=N, prefix_s=0.008))
            out["with_server"] = steady(mport, m.address)
            out["text"] = subprocess.run([sys.executable, "-m", "manager.ctl", "status", "--manager", m.address],
                                         cwd=ROOT, capture_output=True, text=True, timeout=60)
            srv.stop()  # the server leaves the ring
            wait_until(lambda: gauge(scrape(mport), "ring_size") == 0, "the server out of the ring", timeout=20)
            out["server_gone"] = steady(mport, m.address)
        m.kill()  # kill -9, then the same state directory again
        m = cachemanager(state, port, *FLAGS, "--metrics-port", str(mport)).start()
        out["restarted"] = steady(mport, m.address)
        with open(os.path.join(state, "snapshot.json")) as f:
            out["state_counters"] = json.load(f)["state"]["counters"]
    finally:
        srv.kill()
        m.kill()
    return out


def test_a_report_sent_again_is_counted_once_in_the_metrics(run):
    r, st = run["with_server"]
    assert event(r, "rpc_ReportBatches") == 4
    assert event(r, "batch_reports_repeated") == 2  # absent before: only logged
    assert {j["job"]: j["batches"] for j in st["jobs"]} == {"job-a": 9, "job-b": 0}  # 5 + 4, not 15 + 4


def test_every_counter_the_state_keeps_is_exported(run):
    """The model counted autocache decisions that no metric showed."""
    r, _ = run["restarted"]
    assert run["state_counters"].get("autocache_decisions") == 1
    for name, value in run["state_counters"].items():
        assert r.get((f"mlcache_manager_{name}_total", ())) == value, f"state counter {name} not exported"


def test_decision_counters_do_not_go_back_after_a_kill_9_restart(run):
    before, _ = run["server_gone"]
    after, _ = run["restarted"]
    for name in DECISION_COUNTERS:
        key = (f"mlcache_manager_{name}_total", ())
        assert after[key] >= before[key], f"{name} went back from {before[key]} to {after[key]}"
    assert after[("mlcache_manager_ring_changes_total", ())] >= 2  # joined, left
    assert event(after, "rpc_ReportBatches") == 0  # per process, as documented


def _agree(r: dict, st: dict) -> None:
    """The gauges say what Status says of the same state."""
    assert gauge(r, "ring_version") == st["ring_version"]
    assert gauge(r, "ring_size") == sum(s["alive"] for s in st["servers"])
    assert gauge(r, "servers_known") == len(st["servers"])
    assert gauge(r, "jobs") == len(st["jobs"])
    assert gauge(r, "jobs_bypass") == sum(j["mode"] == "CACHE_MODE_BYPASS" for j in st["jobs"])
    assert gauge(r, "jobs_probing") == sum(j["phase"] in ("probe_bypass", "measure_normal") for j in st["jobs"])
    assert gauge(r, "budget_bytes") == st["budget"]
    assert gauge(r, "allocated_bytes") == st["allocated"] == sum(d["allocated_bytes"] for d in st["datasets"])
    assert gauge(r, "journal_seq") == st["journal_seq"]
    for opt in ("none", "chunked", "full"):
        n = sum(d["option"] == f"CACHE_OPTION_{opt.upper()}" for d in st["datasets"])
        assert r[("mlcache_manager_datasets", (("option", opt),))] == n


def test_gauges_agree_with_status_with_a_job_and_after_the_server_left(run):
    for step in ("with_server", "server_gone", "restarted"):
        _agree(*run[step])
    _, st = run["with_server"]
    d = st["datasets"]
    assert any(x["option"] == "CACHE_OPTION_CHUNKED" for x in d)  # the scenario reached chunks
    r, st = run["server_gone"]
    assert [s["alive"] for s in st["servers"]] == [False] and gauge(r, "servers_known") == 1


def test_no_label_names_a_job_dataset_or_server(run):
    r, st = run["with_server"]
    names = {st["servers"][0]["address"], st["servers"][0]["server_id"], DS, "job-a", "job-b"}
    values = {v for _, labels in r for _, v in labels}
    assert not values & names and not any(DS[:16] in v for v in values)


def test_status_text_shows_what_the_json_does(run):
    t = run["text"]
    assert t.returncode == 0, t.stderr
    rows = {line.split()[0]: line.split() for line in t.stdout.splitlines() if line.lstrip().startswith("job-")}
    assert rows["job-a"][-1] == "9" and rows["job-b"][-1] == "0"  # BATCHES
    assert "(1 of 1 servers alive)" in t.stdout


def _keys(x, out: set) -> set:
    if isinstance(x, dict):
        for k, v in x.items():
            out.add(k)
            _keys(v, out)
    elif isinstance(x, list):
        for v in x:
            _keys(v, out)
    return out


def test_every_status_json_field_is_documented(run):
    doc = Path(ROOT, "docs", "manager.md").read_text()
    ops = doc[doc.index("## Operations"):]
    ops = ops[:ops.index("\n## ", 3)]
    keys = set()
    for step in ("with_server", "server_gone", "restarted"):
        _keys(run[step][1], keys)
    assert keys > {"state_digest", "last_heartbeat_age", "loaded_fraction", "waiting", "room_bytes", "prefix_s"}
    missing = sorted(k for k in keys if not re.search(rf"`{k}`", ops))
    assert not missing, f"docs/manager.md, Operations, does not name the Status fields {missing}"
