"""Review of the manager's plan versions and evictions (s31), with real cachemanager and
cacheserver processes.

1. A manager restarted on an empty state dir counted plan versions from 1 again: a client still
   holding an older plan of the same number took the new plan for the one it had (and kept that
   plan's chunk releases). A state started afresh now journals a `plan_floor` at its wall clock
   in ms, so versions never repeat across a restart that lost the state; journals from before
   replay to the state they built.
2. An EvictDataset of a re-planned dataset that landed late on a server whose calls lag deleted
   the new plan's chunk, which the jobs had loaded and the manager activated meanwhile: active
   and empty there for a whole pass. A load report now counts only once every server in the
   ring took the eviction.
3. A put of a chunk after its EvictChunk landed (a client on an older plan): confirmed bounded,
   the next reconcile removes it."""
from __future__ import annotations

import os

from cacheserver.client.server_client import ServerClient
from manager.manager_client import ManagerClient, Plan
from manager.model import ManagerConfig, ManagerModel
from manager.policy import chunk_members
from manager.state import StateStore, _record_line
from procs import cachemanager, cacheserver, free_port, wait_ring, wait_until
from test_review_evictions import DS as E_DS
from test_review_evictions import PausableProxy, _held, _register_server

DS = "5e" * 32
CHUNKED = ("--chunks", "--budget", "30MB", "--chunk-size", "10MB")


def _walk(mc: ManagerClient, job: str, turns: int) -> list[Plan]:
    """Register ``job`` on DS (1000 items, 100 MB: chunked, k = 10) and load and release
    ``turns`` chunks, as its client would; every plan answered."""
    plans = [mc.register_job(job, DS, 100_000_000, 1000).plan]
    for _ in range(turns):
        p = plans[-1]
        if p.loading is not None:
            mc.report_loaded(DS, p.loading, 1.0)
            plans.append(mc.get_plan(DS, job))
        if plans[-1].chunks:
            plans.append(mc.release_chunk(job, DS, plans[-1].chunks[0]))
    return plans


# ---- 1. plan versions across a restart that lost the state -------------------------------
def test_a_manager_restarted_on_an_empty_state_dir_never_repeats_a_plan_version(tmp_path):
    port = free_port()
    m = cachemanager(str(tmp_path / "m1"), port, *CHUNKED).start()
    try:
        with ManagerClient(f"127.0.0.1:{port}", timeout=5) as mc:  # one client, as a job's, throughout
            before = _walk(mc, "job", 4)
            assert before[0].option == "chunked" and before[-1].version > before[0].version
            m.kill()  # its state is lost with it: the next manager starts on an empty directory
            m = cachemanager(str(tmp_path / "m2"), port, *CHUNKED).start()
            after = _walk(mc, "job", 2)  # the job registers again (NOT_FOUND), and goes on the same way
            highest = max(p.version for p in before)
            assert min(p.version for p in after) > highest, \
                f"versions {[p.version for p in after]} repeat those handed out before ({highest} at most)"
            digest, version = mc.status().state_digest, mc.get_plan(DS, "job").version
            m.kill()  # kill -9: the journal (the plan_floor event first) replays to the same state
            m = cachemanager(str(tmp_path / "m2"), port, *CHUNKED).start()
            assert (mc.status(wait=True).state_digest, mc.get_plan(DS, "job").version) == (digest, version)
    finally:
        m.kill()


def test_a_journal_from_before_the_floor_replays_to_the_state_it_built(tmp_path):
    """A state dir with events gets no floor at its next start; it replays to the state it built. Its
    versions, counted from 1 when written, replay lifted to the events' times in ms (s32): above
    those handed out then, so a job takes the replayed plans as new ones."""
    events = [{"type": "job_register", "job": "j", "dataset": DS, "dataset_bytes": 100_000_000,
               "n_items": 1000, "n_gpus": 1, "now": 1000.0, "token_hash": ""},
              {"type": "loaded", "dataset": DS, "chunk": 0, "fraction": 1.0, "now": 1001.0}]
    cfg = ManagerConfig(budget=30_000_000)
    os.makedirs(tmp_path / "s")
    with open(tmp_path / "s" / "journal.jsonl", "w") as f:
        f.writelines(_record_line(i + 1, ev) for i, ev in enumerate(events))
    old = ManagerModel(cfg)
    for ev in events:
        old.apply(ev)
    store = StateStore(str(tmp_path / "s"), cfg, fsync=False).open()
    try:
        assert store.model.digest() == old.digest() and store.model.plan_floor == 0
        assert store.model.plan(DS, "j")["version"] == old.plan(DS, "j")["version"] >= 1_000_000
    finally:
        store.close()
    fresh = StateStore(str(tmp_path / "f"), cfg, fsync=False, clock=lambda: 1_700_000_000.5).open()
    try:  # an empty one starts at its clock, in ms
        assert fresh.model.plan_floor == 1_700_000_000_500 and fresh.seq == 1
        fresh.submit(events[0])
        assert fresh.model.plan(DS, "j")["version"] > 1_700_000_000_500
    finally:
        fresh.close()


# ---- 2. an EvictDataset that lands late on a server behind -------------------------------
def test_a_replanned_chunk_activates_only_once_every_server_took_the_old_plans_eviction(tmp_path):
    """FULL -> CHUNKED (the manager restarted with a smaller --budget): EvictDataset of the old
    entries, and chunk 0 of the new plan loads, while the manager's calls to the server wait (a
    slow link). The jobs put chunk 0 and report it loaded first. Before the fix it became active
    at once, and the late EvictDataset then deleted it: the active chunk held nothing on that
    server (every read of it a miss for a whole pass). Now a loaded report counts only once
    every server in the ring took the eviction."""
    state = str(tmp_path / "m")
    common = ("--chunks", "--chunk-size", "300kB", "--heartbeat-misses", "1000", "--reconcile-seconds", "60",
              "--server-timeout", "20")
    port = free_port()
    m = cachemanager(state, port, *common, "--budget", "4MB").start()
    s = proxy = None
    try:
        s = cacheserver(str(tmp_path / "s"), "64MB", 0, "--data-listen", "127.0.0.1:0").start()
        proxy = PausableProxy(s.address)
        _register_server(m.address, proxy.address)
        wait_ring(m.address, 1)
        keys = [bytes([i + 1]) * 32 for i in range(3)]
        with ManagerClient(m.address, timeout=5) as mc, ServerClient(s.address) as sc:
            def put(c: int, k: int) -> None:
                sc.put([(keys[i], b"v" * 100) for r in chunk_members(c, 3, k) for i in r], dataset=E_DS, chunk=c)

            mc.register_job("job-a", E_DS, 900_000, 3)
            plan = mc.register_job("job-b", E_DS, 900_000, 3).plan
            assert plan.option == "full" and plan.loading == 0
            put(0, 1)
            assert mc.report_loaded(E_DS, 0, 1.0).active == 0
            wait_until(lambda: _held(sc).get(0) == 3 and sc.active_chunk(E_DS) == 0, "FULL loaded on the server")
            m.stop()
            proxy.open.clear()  # the next manager's calls (its first reconcile) wait in the proxy
            m = cachemanager(state, port, *common, "--budget", "700kB").start()  # re-plans: FULL -> CHUNKED
            plan = mc.get_plan(E_DS, "job-a")
            assert (plan.option, plan.k, plan.loading) == ("chunked", 3, 0)
            put(0, 3)  # the jobs load chunk 0 of the new plan, straight to the server
            early = mc.report_loaded(E_DS, 0, 1.0)
            wait_until(lambda: proxy.held > 0, "the manager's calls held in the proxy")
            proxy.open.set()
            wait_until(lambda: not _held(sc), "the EvictDataset landed", 30)
            plan = mc.get_plan(E_DS, "job-a")
            if plan.active == 0:
                assert _held(sc).get(0), (f"chunk 0 is active (the report before the eviction landed "
                                          f"answered active={early.active}) but the server holds none of it")
            assert early.active is None and early.loading == 0  # the report was not counted
            def prefetch_and_report() -> bool:  # as the jobs do: load what is missing, measure, report
                put(0, 3)
                return mc.report_loaded(E_DS, 0, 1.0 if _held(sc).get(0) else 0.0).active == 0

            wait_until(prefetch_and_report, "chunk 0 active once the evictions landed")
            wait_until(lambda: sc.active_chunk(E_DS) == 0, "ActiveChunk(0) on the server")
            assert _held(sc).get(0) == 1
    finally:
        if proxy is not None:
            proxy.close()
        if s is not None:
            s.kill()
        m.kill()


# ---- 3. a put that lands after its chunk's EvictChunk -------------------------------------
def test_a_put_after_its_chunks_eviction_is_removed_by_the_next_reconcile(tmp_path):
    """A client still on an older plan (or mid-insert when the EvictChunk landed) puts items of
    the evicted chunk under its tag: nothing of the plan accounts those bytes, and they are
    removed at the next reconcile (--reconcile-seconds), not left until the chunk's next turn.
    (Where the chunk is resident again, k == 2 or its turn came, they are its own items.)"""
    m = cachemanager(str(tmp_path / "m"), 0, "--chunks", "--budget", "700kB", "--chunk-size", "300kB").start()
    s = cacheserver(str(tmp_path / "s"), "64MB", 0, "--manager", m.address).start()
    try:
        wait_ring(m.address, 1)
        keys = [bytes([i + 1]) * 32 for i in range(3)]
        with ManagerClient(m.address, timeout=5) as mc, ServerClient(s.address) as sc:
            def put(c: int) -> None:
                sc.put([(keys[i], b"v" * 100) for r in chunk_members(c, 3, 3) for i in r], dataset=E_DS, chunk=c)

            mc.register_job("job-a", E_DS, 900_000, 3)
            assert mc.register_job("job-b", E_DS, 900_000, 3).plan.k == 3
            put(0)
            mc.report_loaded(E_DS, 0, 1.0)
            put(1)
            assert mc.report_loaded(E_DS, 1, 1.0).active == 1
            for job in ("job-a", "job-b"):
                plan = mc.release_chunk(job, E_DS, 0)  # chunk 0 goes: EvictChunk(0)
            assert 0 not in (plan.active, plan.loading)
            wait_until(lambda: 0 not in _held(sc), "EvictChunk(0) on the server")
            put(0)  # the late put
            assert _held(sc).get(0) == 1
            wait_until(lambda: 0 not in _held(sc), "the next reconcile removing the late put", 10)
    finally:
        s.kill()
        m.kill()
