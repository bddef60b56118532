"""Servers out of the ring are forgotten after --forget-servers-after (manager/membership.py,
model.py ``server_forget``, decisions.py, actuator.py).

Before the fix the registry kept every server that ever joined: where ids and addresses
change (pods restarted on an empty data dir get a new id and a new IP), the records in
Status, the addresses the actuator owes EvictDatasets to and the owed map itself grew for
the manager's life."""
from __future__ import annotations


import pytest

from cacheserver.client.server_client import ServerClient
from manager.actuator import Actuator, desired_from
from manager.decisions import DecisionLoop
from manager.effects import EvictDataset
from manager.evictledger import StoreLedger
from manager.manager_client import ManagerClient
from manager.managerd import build_parser, config_from_args
from manager.membership import Liveness, Registry
from manager.model import ManagerConfig, ManagerModel, Rejected
from manager.state import StateStore
from procs import cachemanager, cacheserver, free_port, wait_ring, wait_until
from test_review_manager_service import A, B, _full_dataset_on, _keys, _server_of, _stopped

D1, D2 = "d1" * 32, "d2" * 32
# Loopback ports nothing listens on: the actuator's calls there fail at once (owed, then kept).
ADDR1, ADDR2 = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"


def test_the_registry_forgets_only_servers_out_of_the_ring_past_the_retention():
    reg, mono = Registry(), [0.0]
    live = Liveness(1.0, restart_grace=0.0, mono=lambda: mono[0])
    assert reg.join("a", "h:1", 100, 1.0) and reg.join("b", "h:2", 100, 1.0)
    mono[0] = 9.0  # the wall clock, less 1: no step
    assert reg.leave("a", 10.0) and live.forgettable(reg, 10.0, 40.0) == []
    mono[0] = 49.0
    assert live.forgettable(reg, 50.0, 40.0) == []  # 40 s out: not more than 40
    mono[0] = 49.5
    assert live.forgettable(reg, 50.5, 40.0) == ["a"]
    version = reg.version
    assert reg.forget("a").address == "h:1" and sorted(reg.servers) == ["b"]
    assert reg.version == version and reg.addresses() == ["h:2"]  # the ring did not change
    with pytest.raises(ValueError, match="in the ring"):
        reg.forget("b")
    with pytest.raises(KeyError):
        reg.forget("a")


def test_the_model_refuses_to_forget_a_live_or_unknown_server_and_replays_a_forget():
    m = ManagerModel(ManagerConfig(budget=10_000))
    events = [{"type": "server_join", "now": 1.0, "server_id": "a", "address": "h:1", "capacity": 100},
              {"type": "server_join", "now": 1.0, "server_id": "b", "address": "h:2", "capacity": 100},
              {"type": "job_register", "now": 2.0, "job": "j", "dataset": D1, "dataset_bytes": 1000,
               "n_items": 10, "n_gpus": 1},
              {"type": "evictions_owed", "now": 3.0, "owed": {"h:1": [D1], "h:2": [D1]}},
              {"type": "server_leave", "now": 4.0, "server_id": "a", "reason": "test"},
              {"type": "server_forget", "now": 9.0, "server_id": "a", "reason": "test"}]
    for ev in events[:-1]:
        m.apply(ev)
    for sid in ("b", "nobody"):  # in the ring; never known
        with pytest.raises(Rejected, match="cannot forget"):
            m.apply({"type": "server_forget", "now": 5.0, "server_id": sid})
    m.apply(events[-1])
    assert sorted(m.registry.servers) == ["b"] and m.owed == {"h:2": [D1]}  # only the forgotten one's
    again = ManagerModel(ManagerConfig(budget=10_000))
    for ev in events:
        again.apply(ev)
    assert again.digest() == m.digest() == ManagerModel.from_dict(m.to_dict()).digest()


def _open(state_dir: str, clock: list[float]) -> tuple[StateStore, Actuator, Liveness, DecisionLoop]:
    """A manager's parts as managerd.py wires them, on a fake clock (no gRPC service)."""
    now = lambda: clock[0]  # noqa: E731
    act = Actuator(lambda: store.read(desired_from), lambda: store.read(lambda m: m.registry.addresses()),
                   timeout=0.5)
    store = StateStore(state_dir, ManagerConfig(budget=10_000), fsync=False, clock=now, on_effects=act.submit)
    store.open(on_loaded=lambda: act.restore(StoreLedger(store)))
    live = Liveness(now(), restart_grace=1.0)
    loop = DecisionLoop(store, live, act, interval=1.0, heartbeat_s=1.0, misses=3, job_timeout_s=1e6,
                        reconcile_s=1e9, forget_after_s=100.0, clock=now)
    return store, act, live, loop


def test_a_dead_server_is_forgotten_after_the_retention_with_what_it_is_owed_and_stays_so(tmp_path):
    clock = [1000.0]
    store, act, live, loop = _open(str(tmp_path), clock)
    try:
        for sid, addr in (("s1", ADDR1), ("s2", ADDR2)):
            live.beat(sid, clock[0])
            store.submit({"type": "server_join", "server_id": sid, "address": addr, "capacity": 100})
        store.submit({"type": "job_register", "job": "j", "dataset": D1, "dataset_bytes": 1000,
                      "n_items": 10, "n_gpus": 1})
        with store.lock:
            act.submit([EvictDataset(D1, "test")])  # owed to both (their calls fail)
        assert store.read(lambda m: m.owed) == {ADDR1: [D1], ADDR2: [D1]}
        for step in (10.0, 50.0, 60.0):
            clock[0] += step
            live.beat("s2", clock[0])
            loop.run_once()
            servers = store.read(lambda m: dict(m.registry.servers))
            if step == 10.0:  # s1 missed its heartbeats: out of the ring, still listed
                assert not servers["s1"].alive and servers["s2"].alive
            elif step == 50.0:  # 50 s out of the ring: kept
                assert "s1" in servers
        assert sorted(servers) == ["s2"] and live.server("s1") is None  # 110 s out: forgotten
        assert store.read(lambda m: m.owed) == {ADDR2: [D1]}
        assert act.owed(ADDR1) == [] and act.owed(ADDR2) == [D1]
        store.submit({"type": "job_register", "job": "k", "dataset": D2, "dataset_bytes": 1000,
                      "n_items": 10, "n_gpus": 1})
        with store.lock:
            act.submit([EvictDataset(D2, "test")])  # owed to the live server only now
        assert act.owed(ADDR1) == [] and store.read(lambda m: m.owed) == {ADDR2: [D1, D2]}
        digest = store.read(lambda m: m.digest())
    finally:
        act.stop()
        store.close(snapshot=False)  # the next open replays the journal
    store, act, live, loop = _open(str(tmp_path), clock)
    try:
        assert store.replayed > 0 and store.read(lambda m: m.digest()) == digest
        assert sorted(store.read(lambda m: m.registry.servers)) == ["s2"]
        assert StoreLedger(store).known_addresses() == {ADDR2} and act.owed(ADDR1) == []
    finally:
        act.stop()
        store.close()


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_retention_not_above_zero_is_refused_naming_the_flag(value):
    args = build_parser().parse_args(["--listen", "127.0.0.1:0", "--state-dir", "/nonexistent",
                                      "--forget-servers-after", value])
    with pytest.raises(ValueError, match="--forget-servers-after must be"):
        config_from_args(args)
    assert config_from_args(build_parser().parse_args(
        ["--listen", "127.0.0.1:0", "--state-dir", "x"])).forget_servers_after_s == 86400.0


def test_a_killed_server_leaves_status_after_the_retention_and_stays_gone_after_a_restart(tmp_path):
    port = free_port()
    args = ("--forget-servers-after", "2")
    m = cachemanager(str(tmp_path / "m"), port, *args).start()
    s1 = cacheserver(str(tmp_path / "s1"), "64MB", 0, "--manager", m.address).start()
    s2 = cacheserver(str(tmp_path / "s2"), "64MB", 0, "--manager", m.address).start()
    try:
        wait_ring(m.address, 2)
        with ManagerClient(m.address) as mc:
            s1.kill()
            down = wait_until(lambda: [x.address for x in mc.status().servers if not x.alive], "s1 down", 10)
            assert down == [s1.address]
            assert {x.address for x in mc.status().servers} == {s1.address, s2.address}  # kept a while
            wait_until(lambda: len(mc.status().servers) == 1, "s1 forgotten", 15)
            assert [(x.address, x.alive) for x in mc.status().servers] == [(s2.address, True)]
        assert m.stop() == 0
        m = cachemanager(str(tmp_path / "m"), port, *args).start()
        with ManagerClient(m.address) as mc:
            wait_ring(m.address, 1)
            assert [x.address for x in mc.status().servers] == [s2.address]
    finally:
        s1.kill()
        s2.kill()
        m.kill()


def test_a_forgotten_server_back_with_its_data_dir_loses_the_dataset_re_planned_while_away(tmp_path):
    """A FULL dataset's entries (chunk 0, active) are on a server that stops answering, leaves
    the ring and is forgotten; A is then re-planned FULL -> CHUNKED, its EvictDataset owed to
    no one. The server comes back under its old id, unknown now: it registers as a new server
    would, and its old entries of A, whose chunk tags reconcile cannot tell from the new
    plan's, are evicted before it gets the plan."""
    m = cachemanager(str(tmp_path / "m"), 0, "--chunks", "--budget", "300kB", "--chunk-size", "100kB",
                     "--forget-servers-after", "1").start()
    s = _server_of(m, tmp_path)
    keys = _keys(20, 3)
    try:
        wait_ring(m.address, 1)
        with ManagerClient(m.address) as mc, ServerClient(s.address, use_dataplane=False) as sc:
            _full_dataset_on(mc, sc, keys)
            with _stopped(s):
                wait_until(lambda: not mc.status().servers, "the stopped server forgotten", 15)
                mc.register_job("j2", B, 250_000, 25, n_gpus=8)
                assert mc.get_plan(A, "j1").option == "chunked"
            wait_ring(m.address, 1)
            wait_until(lambda: sc.lookup(keys) == b"\0" * 20, "the old plan's entries evicted", 15)
            plan = mc.get_plan(A, "j1")
            wait_until(lambda: sc.stats().active_chunks.get(A) == plan.active, "then the current plan", 20)
            assert [x.alive for x in mc.status().servers] == [True]
    finally:
        s.kill()
        m.kill()
