"""Integration tests: a real cachemanager and real cacheservers on loopback.

Intervals are shortened by flags (heartbeat and decision loop every 0.2 s), so
every wait below is a bounded poll of a few seconds at most.
"""
import random
import time
import urllib.request

import pytest

from cacheserver.client.server_client import ServerClient
from cacheserver.vocab import CacheMode
from manager.manager_client import ManagerClient, ManagerError, ManagerUnavailable
from manager.policy import chunk_members
from procs import cachemanager, cacheserver, free_port

DS_IO = "a1" * 32      # fingerprints: hex digests of the digest files
DS_CPU = "c3" * 32
DS_CH = "d4" * 32


def wait_for(cond, timeout=8.0, interval=0.05, what="condition"):
    """Poll `cond` until it returns a truthy value; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


OLD_POLICY = ("--chunks", "--bypass-probes")


@pytest.fixture
def cluster(tmp_path):
    """Start processes with cluster.manager(...)/cluster.server(...); all killed at teardown."""
    procs = []

    class Cluster:
        def manager(self, *extra, state="m", port=0):
            # These tests drive the chunk knapsack and Quiver's bypass probes, both
            # selectable; the default (shares, passive) is tested where named.
            d = cachemanager(str(tmp_path / state), port, *OLD_POLICY, *extra).start()
            procs.append(d)
            return d

        def server(self, name, manager, capacity="64MB", port=0):
            # data plane on any free port, not gRPC port + 1 (which another daemon here may hold)
            d = cacheserver(str(tmp_path / name), capacity, port, "--manager", manager.address,
                            "--data-listen", "127.0.0.1:0").start()
            procs.append(d)
            return d

    yield Cluster()
    for p in procs:
        p.kill()


def ring(mc):
    return mc.get_ring()


def status(mc):
    return mc.status_dict()


def by(items, key):
    return {x[key]: x for x in items}


def test_servers_register_and_appear_in_ring(cluster):
    m = cluster.manager()
    s1, s2 = cluster.server("s1", m), cluster.server("s2", m)
    with ManagerClient(m.address) as mc:
        r = wait_for(lambda: (x := ring(mc)) and len(x.addresses) == 2 and x, what="two servers in the ring")
        assert sorted(r.addresses) == sorted([s1.address, s2.address])
        assert r.version == 2  # one bump per join
        st = status(mc)
        assert all(s["alive"] for s in st["servers"]) and int(st["budget"]) == 2 * 64_000_000
        assert st["budget_from_capacity"] is True
    # Info.peers follows the manager's ring, so RingClient.resolve(one address) finds all.
    with ServerClient(s1.address) as c:
        wait_for(lambda: sorted(c.info().peers) == sorted(r.addresses), what="Info.peers = ring")


def test_killed_server_leaves_ring_and_rejoins(cluster, tmp_path):
    m = cluster.manager()
    s1, s2 = cluster.server("s1", m), cluster.server("s2", m)
    with ManagerClient(m.address) as mc:
        v0 = wait_for(lambda: len(ring(mc).addresses) == 2 and ring(mc).version, what="ring of two")
        port = int(s1.address.rsplit(":", 1)[1])
        s1.proc.kill()  # kill -9: no goodbye
        s1.proc.wait()
        t0 = time.monotonic()
        r = wait_for(lambda: (x := ring(mc)) and len(x.addresses) == 1 and x, timeout=5, what="s1 to leave")
        assert time.monotonic() - t0 < 3.0  # 3 missed heartbeats of 0.2 s + one decision round
        assert r.addresses == (s2.address,) and r.version == v0 + 1
        assert int(status(mc)["budget"]) == 64_000_000  # the budget follows the ring
        s1b = cluster.server("s1", m, port=port)  # same data dir (same server id), same port
        r = wait_for(lambda: (x := ring(mc)) and len(x.addresses) == 2 and x, what="s1 to rejoin")
        assert s1b.address in r.addresses and r.version == v0 + 2
        down = by(status(mc)["servers"], "address")
        assert down[s1b.address]["alive"] and len(down) == 2  # the same record, not a new one


def _feed(mc, job, t_bypass, t_normal, hit, clock, max_reports=60):
    """Report batches in groups of 5 like a client that measures each under the
    mode the manager last told it; returns the modes seen. Timestamps come from
    a synthetic clock that never falls behind real time, so every batch started
    after the mode switch that precedes it."""
    modes = []
    mode = "bypass"
    for _ in range(max_reports):
        dur = t_bypass if mode == "bypass" else t_normal
        h = 0.0 if mode == "bypass" else hit
        batch = []
        for _ in range(5):
            clock[0] = max(clock[0], time.time()) + dur
            batch.append((clock[0], dur, h))
        mode = mc.report_batches(job, batch).mode
        modes.append(mode)
        job_st = by(status(mc)["jobs"], "job")[job]
        if job_st["phase"] == "decided":
            return modes, job_st
    raise AssertionError(f"{job}: no decision after {max_reports} reports: {modes}")


def test_probing_sets_bypass_on_servers_and_drives_allocation(cluster):
    m = cluster.manager()
    s = cluster.server("s1", m)
    with ManagerClient(m.address) as mc, ServerClient(s.address) as sc:
        wait_for(lambda: len(ring(mc).addresses) == 1, what="server registered")
        io = mc.register_job("job-io", DS_IO, 8_000_000, 1000, n_gpus=4)
        cpu = mc.register_job("job-cpu", DS_CPU, 8_000_000, 1000, n_gpus=4)
        assert io.mode == cpu.mode == "bypass"  # the first probe starts at once
        # Unmeasured datasets get space on the prior, so clients fill them.
        assert io.plan.option == cpu.plan.option == "full"
        wait_for(lambda: dict(sc.stats().job_modes) == {"job-io": CacheMode.BYPASS.code, "job-cpu": CacheMode.BYPASS.code},
                 what="both jobs in bypass on the server")
        keys = ids(20, seed=1)
        sc.put([(k, b"x" * 1000) for k in keys], job="job-cpu", dataset=DS_CPU, chunk=0)

        clock = [time.time()]
        modes, js = _feed(mc, "job-io", 0.1, 0.02, 1.0, clock)  # I/O bound: 5x faster from the cache
        assert "normal" in modes and js["benefit"] == pytest.approx(5.0) and not js["inconclusive"]
        modes, js = _feed(mc, "job-cpu", 0.1, 0.1, 1.0, clock)  # compute bound: no faster
        assert js["benefit"] == pytest.approx(1.0)
        wait_for(lambda: not sc.stats().job_modes, what="both jobs back to normal on the server")

        ds = wait_for(lambda: (d := by(status(mc)["datasets"], "dataset"))
                      and d[DS_CPU]["option"] == "CACHE_OPTION_NONE" and d, what="compute-bound -> none")
        assert ds[DS_IO]["option"] in ("CACHE_OPTION_FULL", "CACHE_OPTION_CHUNKED")
        assert "no job benefits" in ds[DS_CPU]["reason"]
        assert mc.get_plan(DS_CPU, "job-cpu").option == "none"
        assert mc.get_plan(DS_IO, "job-io").readable(123)
        # Enforcement: the compute-bound dataset's entries are evicted from the server.
        wait_for(lambda: not [c for c in sc.stats().chunks if c.dataset == DS_CPU], what="DS_CPU evicted")
        assert sc.lookup(keys) == b"\0" * 20


def test_double_buffering_staggered_jobs_and_forced_straggler_eviction(cluster):
    mport = free_port()
    m = cluster.manager("--budget", "300kB", "--chunk-size", "100kB", "--straggler-seconds", "1",
                        "--straggler-min-seconds", "1", "--metrics-port", str(mport))
    s = cluster.server("s1", m)
    n = 100  # 1 MB in 100 items: k = 10 chunks of 100 kB; two fit in the budget, the whole does not
    with ManagerClient(m.address) as mc, ServerClient(s.address) as sc:
        wait_for(lambda: len(ring(mc).addresses) == 1, what="server registered")
        a = mc.register_job("job-a", DS_CH, 1_000_000, n)
        mc.register_job("job-b", DS_CH, 1_000_000, n)
        assert a.plan.option == "chunked" and a.plan.k == 10
        assert a.plan.loading == 0 and a.plan.active is None and a.plan.chunks == (0,)  # cold start
        assert mc.get_plan(DS_CH, "job-b").chunks == (0,)
        # Clients fill chunk 0 with co-operative misses, tagged with the chunk.
        keys = ids(n, seed=2)
        sc.put([(keys[i], b"v" * 100) for r in chunk_members(0, n, 10) for i in r], dataset=DS_CH, chunk=0)
        p = mc.report_loaded(DS_CH, 0, 1.0)
        assert (p.active, p.loading) == (0, 1)  # active; the next chunk preloads at once
        wait_for(lambda: sc.active_chunk(DS_CH) == 0, what="ActiveChunk pushed to the server")

        pa = mc.release_chunk("job-a", DS_CH, 0)  # job-a finished its pass first ...
        assert pa.chunks == (1,)                   # ... and helps load chunk 1
        p = mc.report_loaded(DS_CH, 1, 0.99, job="job-b")
        assert (p.active, p.loading) == (1, None) and p.chunks == (0,)  # job-b's plan: still on chunk 0
        st = by(status(mc)["datasets"], "dataset")[DS_CH]
        assert st["marked"] == 0 and by(st["chunks"], "chunk")[0]["jobs"] == ["job-b"]  # straggler holds it
        c = mc.register_job("job-c", DS_CH, 1_000_000, n)  # a late job starts on the newest chunk
        assert c.plan.chunks == (1,)

        # job-b never releases: forced eviction 1 s (the straggler timeout) after job-a's release.
        st = wait_for(lambda: (d := by(status(mc)["datasets"], "dataset")[DS_CH]) and d["marked"] == -1 and d,
                      timeout=6, what="forced eviction of the straggler's chunk")
        assert st["active"] == 1 and st["loading"] == 2
        assert mc.get_plan(DS_CH, "job-b").chunks == (1,)  # moved to the newest chunk
        wait_for(lambda: not [x for x in sc.stats().chunks if x.dataset == DS_CH and x.chunk == 0],
                 what="chunk 0 evicted on the server")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
        assert "mlcache_manager_chunk_evictions_forced_total 1.0" in metrics
        assert "mlcache_manager_ring_size 1.0" in metrics

        # Everyone finishes chunk 1 in turn: the marked chunk goes without force.
        for job in ("job-a", "job-b", "job-c"):
            assert mc.release_chunk(job, DS_CH, 1).chunks == (2,)
        p = mc.report_loaded(DS_CH, 2, 1.0)
        assert (p.active, p.loading) == (2, 3)
        st = by(status(mc)["datasets"], "dataset")[DS_CH]
        assert [x["chunk"] for x in st["chunks"]] == [2, 3]  # never more than two resident
        assert "mlcache_manager_chunk_evictions_total 1.0" in \
            urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
        with pytest.raises(ManagerError) as e:
            mc.release_chunk("job-a", DS_CH, 10)
        assert "out of range" in str(e.value) and not isinstance(e.value, ManagerUnavailable)


def _comparable(st):
    """Status without what legitimately differs across a restart (clock, heartbeat ages)."""
    st = dict(st)
    st.pop("now")
    st["servers"] = [{k: v for k, v in s.items() if k not in ("last_heartbeat_age", "used", "items")}
                     for s in st["servers"]]
    return st


@pytest.mark.parametrize("snapshot_every", ["1000", "3"])
def test_manager_kill9_restart_restores_identical_state(cluster, snapshot_every):
    extra = ("--budget", "300kB", "--chunk-size", "100kB", "--snapshot-every", snapshot_every)
    m = cluster.manager(*extra)
    cluster.server("s1", m), cluster.server("s2", m)
    with ManagerClient(m.address) as mc:
        wait_for(lambda: len(ring(mc).addresses) == 2, what="two servers")
        for job in ("j1", "j2"):
            mc.register_job(job, DS_CH, 1_000_000, 100, n_gpus=2)
        mc.register_job("j3", DS_IO, 50_000, 10)
        mc.report_loaded(DS_CH, 0, 1.0)
        mc.release_chunk("j1", DS_CH, 0)
        mc.report_loaded(DS_CH, 1, 1.0)  # chunk 0 marked, j2 still on it
        clock = [time.time()]
        for _ in range(3):  # a probe in progress: its samples are state too
            batch = []
            for _ in range(5):
                clock[0] = max(clock[0], time.time()) + 0.05
                batch.append((clock[0], 0.05, None))
            mc.report_batches("j1", batch)
        time.sleep(0.5)  # a few quiet decision rounds: nothing changes
        before = status(mc)
        assert _comparable(status(mc)) == _comparable(before)  # quiescent
        plan_j2 = mc.get_plan(DS_CH, "j2")
        tokens = {job: mc.job_token(job) for job in ("j1", "j2")}
    m.proc.kill()
    m.proc.wait()
    port = int(m.address.rsplit(":", 1)[1])
    m2 = cluster.manager(*extra, port=port)
    with ManagerClient(m2.address) as mc:
        after = status(mc)
        assert _comparable(after) == _comparable(before)
        assert after["state_digest"] == before["state_digest"]  # the rest of the state, too
        # Jobs re-attach with their tokens (journaled): their plans, reports and releases just work.
        for job, token in tokens.items():
            mc.set_job_token(job, token)
        assert mc.get_plan(DS_CH, "j2") == plan_j2
        # Servers re-attach: heartbeats arrive, nobody left the ring.
        wait_for(lambda: all(s["last_heartbeat_age"] >= 0 for s in status(mc)["servers"]),
                 what="heartbeats after the restart")
        assert ring(mc).version == int(before["ring_version"])
        mc.report_batches("j1", [(time.time(), 0.05, None)])
        assert mc.release_chunk("j2", DS_CH, 0).chunks == (1,)
        assert mc.register_job("j1", DS_CH, 1_000_000, 100, n_gpus=2).plan.chunks == (1,)


def test_clients_keep_working_while_the_manager_is_down(cluster, tmp_path):
    m = cluster.manager()
    s = cluster.server("s1", m)
    port = int(m.address.rsplit(":", 1)[1])
    with ManagerClient(m.address, timeout=1.0) as mc, ServerClient(s.address) as sc:
        wait_for(lambda: len(ring(mc).addresses) == 1, what="server registered")
        info = mc.register_job("job", DS_IO, 50_000, 10)
        plan = mc.get_plan(DS_IO, "job")
        wait_for(lambda: sc.stats().job_modes.get("job") == CacheMode.BYPASS.code, what="probe pushed to the server")
        m.proc.kill()
        m.proc.wait()
        for call in (lambda: mc.get_plan(DS_IO, "job"), lambda: mc.report_batches("job", [(time.time(), 0.1)]),
                     lambda: mc.release_chunk("job", DS_IO, 0), mc.get_ring):
            t0 = time.monotonic()
            with pytest.raises(ManagerUnavailable):
                call()
            assert time.monotonic() - t0 < 2.0
        assert mc.last_plan(DS_IO, "job") == plan == info.plan
        # The data path does not need the manager. ("job" itself is still in its
        # first probe, so the server keeps answering it with misses, as decided.)
        keys = ids(5, seed=3)
        sc.put([(k, b"data") for k in keys], job="job", dataset=DS_IO, chunk=0)
        assert [bytes(v) for v in sc.get(keys, job="job-2")] == [b"data"] * 5
        assert sc.get(keys, job="job") == [None] * 5
        # A manager back with a fresh state directory: the server registers again by itself.
        m2 = cluster.manager(state="m-fresh", port=port)
        wait_for(lambda: _ring_or_none(mc) == (s.address,), timeout=8, what="server re-registered")
        assert mc.register_job("job", DS_IO, 50_000, 10).plan.option == "full"
        assert m2.stop() == 0  # SIGTERM drains and exits 0


def _ring_or_none(mc):
    try:
        return mc.get_ring().addresses
    except ManagerUnavailable:
        return None


def test_mutual_tls_end_to_end_and_cachectl_status(tmp_path):
    """Manager, server and clients all on mutual TLS: registration, the pushed
    probe mode, and `cachectl status` (table and --json)."""
    import argparse
    import io
    import json

    from cacheserver.certs import write_bundle
    from cacheserver.tls import TlsFiles
    from manager.status import add_status_parser

    b = write_bundle(tmp_path / "certs")
    srv_tls = ["--tls-cert", str(b.server_cert), "--tls-key", str(b.server_key), "--tls-ca", str(b.ca)]
    cli = TlsFiles(str(b.client_cert), str(b.client_key), str(b.ca))
    mgr_tls = ["--tls-cert", str(b.manager_cert), "--tls-key", str(b.manager_key), "--tls-ca", str(b.ca)]
    m = cachemanager(str(tmp_path / "m"), 0, *OLD_POLICY, *mgr_tls).start()  # the manager role (roles.py)
    s = cacheserver(str(tmp_path / "s"), "64MB", 0, "--manager", m.address, "--data-listen", "127.0.0.1:0",
                    *srv_tls).start()
    try:
        as_mgr = TlsFiles(str(b.manager_cert), str(b.manager_key), str(b.ca))  # Stats with tenants
        with ManagerClient(m.address, tls=cli) as mc, ServerClient(s.address, tls=as_mgr) as sc:
            wait_for(lambda: ring(mc).addresses == (s.address,), what="server registered over TLS")
            assert mc.register_job("job-tls", DS_IO, 50_000, 10).mode == "bypass"
            wait_for(lambda: sc.stats().job_modes.get("job-tls") == CacheMode.BYPASS.code, what="mode pushed over TLS")
        with ManagerClient(m.address, timeout=1.0) as plain:  # no client certificate: refused
            with pytest.raises(ManagerUnavailable):
                plain.get_ring()
        parser = argparse.ArgumentParser()
        add_status_parser(parser.add_subparsers(dest="command"))
        from manager.status import run_status
        client_args = ["--tls-cert", str(b.client_cert), "--tls-key", str(b.client_key), "--tls-ca", str(b.ca)]
        out = io.StringIO()  # a client certificate: other tenants' jobs are only counted
        assert run_status(parser.parse_args(["status", "--manager", m.address, *client_args, "--timeout", "30"]), out) == 0
        assert "job-tls" not in out.getvalue() and DS_IO[:16] not in out.getvalue()
        assert "1 other jobs and 1 other datasets not shown" in out.getvalue()
        tls_args = mgr_tls  # the manager's certificate: everything
        out = io.StringIO()
        assert run_status(parser.parse_args(["status", "--manager", m.address, *tls_args, "--timeout", "30"]), out) == 0
        text = out.getvalue()
        assert s.address in text and "job-tls" in text and "probe_bypass" in text and "full" in text
        out = io.StringIO()
        assert run_status(parser.parse_args(["status", "--manager", m.address, "--json", *tls_args, "--timeout", "30"]), out) == 0
        doc = json.loads(out.getvalue())
        assert doc["jobs"][0]["job"] == "job-tls" and doc["datasets"][0]["option"] == "CACHE_OPTION_FULL"
        args = parser.parse_args(["status", "--manager", m.address, "--timeout", "0.5"])
        assert args.func(args, args.subparser) == 1  # how ctl.main calls it; no certificate -> exit 1
    finally:
        s.kill()
        m.kill()


def test_dataset_without_room_keeps_spare_entries_and_loses_chunk_entries(cluster):
    """Two chunks do not fit the budget: the plan is NONE with spare entries, so
    concurrent jobs still share their misses in room nobody needs. Reconciling the
    servers keeps those spare entries and evicts anything under a chunk tag."""
    m = cluster.manager("--budget", "100kB", "--chunk-size", "100kB")
    s = cluster.server("s1", m)
    with ManagerClient(m.address) as mc, ServerClient(s.address) as sc:
        wait_for(lambda: len(ring(mc).addresses) == 1, what="server registered")
        for job in ("j1", "j2"):
            plan = mc.register_job(job, DS_CH, 1_000_000, 100, n_gpus=1).plan
        assert (plan.option, plan.spare) == ("none", True)
        assert "misses shared as spare entries" in by(status(mc)["datasets"], "dataset")[DS_CH]["reason"]
        spare, chunked = ids(5, seed=7), ids(3, seed=8)
        sc.put([(k, b"s" * 1000) for k in spare], dataset=DS_CH, chunk=-1)
        sc.put([(k, b"c" * 1000) for k in chunked], dataset=DS_CH, chunk=0)
        wait_for(lambda: sc.lookup(chunked) == b"\0" * 3, what="chunk entries of a NONE dataset evicted")
        time.sleep(0.5)  # a few more reconcile rounds
        assert sc.lookup(spare) == b"\1" * 5
