"""Manager state machine and journal, in process (no daemons): replay after a
crash gives back exactly the acknowledged state."""
import json
import os
import random

import pytest

from manager.membership import Liveness, Registry
from manager.model import ManagerConfig, ManagerModel, Rejected
from manager.policy import AllocConfig, BufferConfig, ProbeConfig
from manager.state import StateError, StateStore

CFG = ManagerConfig(budget=400_000, dataset_grace_s=5.0,
                    probe=ProbeConfig(warmup_batches=1, min_batches=3, max_batches=6, max_phase_s=30.0,
                                      reprobe_interval_s=40.0, retry_after_abort_s=10.0),
                    alloc=AllocConfig(chunk_bytes=100_000, mechanism="chunks"),
                    buffer=BufferConfig(straggler_timeout_s=4.0, min_straggler_s=2.0, max_straggler_s=20.0))


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def random_events(seed, n=400, model=None):
    """A plausible random workload: servers come and go, jobs register, report
    batches, release chunks, chunks load, time passes. With ``model``, chunk
    numbers mostly follow its plans (as real clients would)."""
    rng = random.Random(seed)

    def chunk(ds, job=None):
        buf = model.buffers.get(ds) if model is not None else None
        if buf is not None and rng.random() < 0.8:
            c = buf.jobs[job].chunk if job in buf.jobs else buf.loading
            if c is not None:
                return c
        return rng.randrange(10)

    datasets = {"d1": (1_000_000, 100), "d2": (300_000, 40), "d3": (50_000, 10)}
    jobs = {}
    t = 1000.0
    for _ in range(n):
        t += rng.choice([0.0, 0.1, 0.5, 2.0])
        r = rng.random()
        if r < 0.08:
            sid = rng.choice("abc")
            yield {"type": "server_join", "server_id": sid, "address": f"10.0.0.{ord(sid)}:7000",
                   "capacity": rng.choice([200_000, 300_000]), "now": t}
        elif r < 0.11:
            yield {"type": "server_leave", "server_id": rng.choice("abc"), "reason": "test", "now": t}
        elif r < 0.2:
            job = f"j{rng.randrange(6)}"
            ds = jobs.get(job) or rng.choice(sorted(datasets))
            jobs[job] = ds
            size, items = datasets[ds]
            yield {"type": "job_register", "job": job, "dataset": ds, "dataset_bytes": size, "n_items": items,
                   "n_gpus": rng.choice([1, 4]), "now": t}
        elif r < 0.25 and jobs:
            job = rng.choice(sorted(jobs))
            del jobs[job]
            yield {"type": "job_unregister", "job": job, "reason": "done", "now": t}
        elif r < 0.55 and jobs:
            job = rng.choice(sorted(jobs))
            dur = rng.choice([0.05, 0.1, 0.2])
            yield {"type": "batches", "job": job, "now": t,
                   "batches": [[t + i * dur, dur, rng.choice([None, 1.0, 0.5])] for i in range(3)]}
        elif r < 0.7 and jobs:
            job = rng.choice(sorted(jobs))
            yield {"type": "release", "job": job, "dataset": jobs[job], "chunk": chunk(jobs[job], job), "now": t}
        elif r < 0.85:
            ds = rng.choice(sorted(datasets))
            yield {"type": "loaded", "dataset": ds, "chunk": chunk(ds), "fraction": rng.choice([0.5, 1.0]),
                   "now": t}
        else:
            yield {"type": "tick", "now": t}


def run(store, events):
    applied = 0
    for ev in events:
        try:
            store.submit(ev, only_if_changed=ev["type"] == "tick")
            applied += 1
        except Rejected:
            pass
    return applied


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("snapshot_every", [1, 7, 100000])
def test_replay_after_crash_gives_identical_state(tmp_path, seed, snapshot_every):
    store = StateStore(str(tmp_path), CFG, snapshot_every=snapshot_every, fsync=False).open()
    assert run(store, random_events(seed, model=store.model)) > 100
    live = store.model.to_dict()
    seq = store.seq
    # Simulated kill -9: no close(), no final snapshot; just drop the lock.
    os.close(store._lock_fd)
    os.close(store._journal_fd)
    again = StateStore(str(tmp_path), CFG, fsync=False).open()
    assert again.model.to_dict() == live
    assert again.model.digest() == ManagerModel.from_dict(live).digest()
    assert again.seq == seq
    again.close()


def test_state_actually_exercises_the_policy(tmp_path):
    store = StateStore(str(tmp_path), CFG, fsync=False).open()
    run(store, random_events(3, 1500, store.model))
    c = store.model.counters
    assert c.get("decisions", 0) > 3 and c.get("probes_finished", 0) > 0 and c.get("ring_changes", 0) > 2
    assert c.get("chunk_evictions", 0) + c.get("chunk_evictions_forced", 0) > 0
    store.close()


def test_torn_tail_is_dropped_and_damage_elsewhere_refused(tmp_path):
    store = StateStore(str(tmp_path), CFG, fsync=False).open()
    run(store, list(random_events(1, 60)))
    live, seq = store.model.to_dict(), store.seq
    store.close(snapshot=False)
    path = os.path.join(tmp_path, "journal.jsonl")
    with open(path, "ab") as f:
        f.write(b'{"seq": 99999, "ev": {"type": "tick", "no')  # crash mid-write
    again = StateStore(str(tmp_path), CFG, fsync=False).open()
    assert again.model.to_dict() == live and again.seq == seq
    for t in range(3):
        again.submit({"type": "tick", "now": 1e9 + t})  # journal usable again
    again.close(snapshot=False)
    lines = open(path, "rb").read().split(b"\n")
    assert all(json.loads(x) for x in lines if x)
    lines.insert(1, b"garbage")
    open(path, "wb").write(b"\n".join(lines))
    with pytest.raises(StateError, match="damaged record"):
        StateStore(str(tmp_path), CFG, fsync=False).open()


def test_a_flipped_byte_that_keeps_json_valid_is_damage_not_another_value(tmp_path):
    """Each journal line carries its record's CRC-32: a digit changed inside a complete line
    (still valid JSON) stops the load naming the line, in the middle and at the end alike,
    instead of replaying the event with another value."""
    store = StateStore(str(tmp_path), CFG, fsync=False).open()
    for t in range(3):
        store.submit({"type": "tick", "now": 1e9 + t})
    store.close(snapshot=False)
    path = os.path.join(tmp_path, "journal.jsonl")
    good = open(path, "rb").read()
    lines = good.split(b"\n")
    assert all(b'"crc":' in x for x in lines if x)
    for k in (1, len([x for x in lines if x]) - 1):  # the middle, the last line
        bad = list(lines)
        bad[k] = bad[k].replace(b'"now":100000000', b'"now":900000000', 1)
        assert bad[k] != lines[k] and json.loads(bad[k])
        open(path, "wb").write(b"\n".join(bad))
        with pytest.raises(StateError, match=f"at line {k + 1} is damaged"):
            StateStore(str(tmp_path), CFG, fsync=False).open()
    # lines written before the CRC (none) still load
    open(path, "wb").write(b"\n".join(json.dumps({k: v for k, v in json.loads(x).items() if k != "crc"}).encode()
                                       if x else x for x in lines))
    again = StateStore(str(tmp_path), CFG, fsync=False).open()
    assert again.seq >= 3
    again.close(snapshot=False)


def test_a_torn_tail_is_cut_in_place_and_a_lost_newline_restored(tmp_path, monkeypatch):
    """The cut keeps the good records where they are (the file is never emptied first, so a
    crash during the cut loses nothing acknowledged)."""
    store = StateStore(str(tmp_path), CFG, fsync=False).open()
    run(store, list(random_events(2, 30)))
    live, seq = store.model.to_dict(), store.seq
    store.close(snapshot=False)
    path = os.path.join(tmp_path, "journal.jsonl")
    good = open(path, "rb").read()
    open(path, "wb").write(good.rstrip(b"\n"))  # the last record lost its newline
    with open(path, "ab") as f:
        f.write(b'\n{"seq": 99999, "ev": {"ty')
    real_open = open

    def no_rewrite(file, mode="r", *a, **kw):
        assert not (file == path and "w" in mode), "the journal was opened to be rewritten"
        return real_open(file, mode, *a, **kw)

    monkeypatch.setattr("builtins.open", no_rewrite)
    again = StateStore(str(tmp_path), CFG, fsync=False).open()
    assert again.model.to_dict() == live and again.seq == seq
    again.close(snapshot=False)


def test_a_failed_snapshot_does_not_undo_the_event(tmp_path):
    """Events are durable once journaled: a snapshot that cannot be written (here its temp
    file's name is taken by a directory) is logged and tried again, never the caller's error."""
    store = StateStore(str(tmp_path), CFG, fsync=False, snapshot_every=1).open()
    os.mkdir(os.path.join(tmp_path, "snapshot.json.tmp"))
    taken = store.snapshots
    assert run(store, list(random_events(3, 10))) > 0
    live, seq = store.model.to_dict(), store.seq
    assert store.snapshots == taken
    os.rmdir(os.path.join(tmp_path, "snapshot.json.tmp"))
    store.close(snapshot=False)
    again = StateStore(str(tmp_path), CFG, fsync=False).open()
    assert again.model.to_dict() == live and again.seq == seq
    again.close()


def test_one_manager_per_state_dir_and_damaged_snapshot(tmp_path):
    a = StateStore(str(tmp_path), CFG, fsync=False).open()
    with pytest.raises(StateError, match="in use"):
        StateStore(str(tmp_path), CFG, fsync=False).open()
    a.close()
    snap = os.path.join(tmp_path, "snapshot.json")
    doc = json.load(open(snap))
    doc["state"]["now"] = 5.0
    json.dump(doc, open(snap, "w"))
    with pytest.raises(StateError, match="digest mismatch"):
        StateStore(str(tmp_path), CFG, fsync=False).open()


def test_quiet_ticks_and_refusals_are_not_journaled(tmp_path):
    clock = Clock()
    store = StateStore(str(tmp_path), CFG, fsync=False, clock=clock).open()
    store.submit({"type": "server_join", "server_id": "a", "address": "h:1", "capacity": 10})
    seq = store.seq
    for _ in range(5):
        clock.t += 1
        store.submit({"type": "tick"}, only_if_changed=True)
    assert store.seq == seq and store.model.now == 1000.0
    with pytest.raises(Rejected) as e:
        store.submit({"type": "batches", "job": "nobody", "batches": []})
    assert e.value.code == "NOT_FOUND" and store.seq == seq
    with pytest.raises(Rejected):
        store.submit({"type": "job_register", "job": "j", "dataset": "d", "dataset_bytes": 10, "n_items": 1,
                      "n_gpus": 0})
    assert store.seq == seq
    store.close()


def test_changed_flags_become_a_journaled_configure_event(tmp_path):
    StateStore(str(tmp_path), CFG, fsync=False).open().close()
    bigger = ManagerConfig(**{**CFG.__dict__, "budget": 10**9})
    s = StateStore(str(tmp_path), bigger, fsync=False).open()
    assert s.model.config == bigger and s.model.budget() == 10**9
    s.close()
    s = StateStore(str(tmp_path), bigger, fsync=False).open()
    assert s.model.config == bigger
    s.close()


def test_registry_versions_and_liveness():
    reg = Registry()
    assert reg.join("a", "h:1", 100, 1.0) and reg.join("b", "h:2", 50, 1.0)
    assert reg.version == 2 and reg.capacity() == 150
    assert not reg.join("a", "h:1", 100, 2.0)            # re-register: no change
    assert not reg.needs_join("a", "h:1", 100) and reg.needs_join("a", "h:1", 200)
    assert reg.leave("a", 3.0) and reg.addresses() == ["h:2"] and reg.version == 3
    assert reg.join("a", "h:1", 100, 4.0) and reg.servers["a"].joins == 2
    assert not reg.join("c", "h:2", 70, 5.0)  # new id on b's address replaces b; same ring
    assert reg.addresses() == ["h:1", "h:2"] and "b" not in reg.servers and reg.capacity() == 170
    assert Registry.from_dict(reg.to_dict()) == reg
    live = Liveness(started=100.0, restart_grace=5.0)
    live.beat("a", 100.5)
    assert live.dead_servers(reg, 101.0, timeout=1.0) == []
    assert live.dead_servers(reg, 102.0, timeout=1.0) == ["a"]          # missed beats
    assert live.dead_servers(reg, 106.0, timeout=1.0) == ["a", "c"]     # c: restart grace over


def test_a_new_id_on_a_down_servers_address_replaces_its_record():
    """A server whose data dir was wiped comes back under a new id: the old record goes,
    rather than being listed as down for ever."""
    reg = Registry()
    assert reg.join("a", "h:1", 100, 1.0) and reg.leave("a", 2.0)
    assert reg.join("b", "h:1", 100, 3.0)
    assert sorted(reg.servers) == ["b"] and reg.addresses() == ["h:1"]


def test_a_dataset_without_room_shares_misses_as_spare_until_its_jobs_gain_nothing():
    """Two chunks do not fit: NONE, but the jobs may insert spare entries (room
    nobody needs). Once probing shows the jobs gain nothing, spare is turned off:
    a new plan version, but no eviction (a new job's prior would turn it on
    again, and each flip would cost a reload). The entries go when the dataset
    is forgotten, after its grace period; until then it keeps them."""
    from dataclasses import replace

    from manager.effects import EvictDataset

    m = ManagerModel(replace(CFG, budget=150_000))
    m.apply({"type": "job_register", "job": "a", "dataset": "big", "dataset_bytes": 5_000_000, "n_items": 500,
             "n_gpus": 1, "now": 1000.0})
    m.apply({"type": "job_register", "job": "b", "dataset": "big", "dataset_bytes": 5_000_000, "n_items": 500,
             "n_gpus": 1, "now": 1000.0})
    plan = m.plan("big", "a")
    assert (plan["option"], plan["spare"]) == ("none", True)
    v0, t, effects = plan["version"], 1000.0, []
    for _ in range(40):  # compute-bound: just as fast in bypass as with the cache
        for job in ("a", "b"):
            t += 0.1
            effects += m.apply({"type": "batches", "job": job, "now": t, "batches": [[t, 0.1, 1.0]]})
        effects += m.apply({"type": "tick", "now": t})
        if not m.allocs["big"].spare:
            break
    plan = m.plan("big", "a")
    assert (plan["option"], plan["spare"]) == ("none", False) and plan["version"] > v0
    assert "no job benefits" in m.allocs["big"].reason
    assert not any(isinstance(e, EvictDataset) for e in effects)
    assert ManagerModel.from_dict(m.to_dict()).allocs["big"].spare is False
    # a new job brings the prior back: spare on again, and still nothing evicted
    effects = m.apply({"type": "job_register", "job": "c", "dataset": "big", "dataset_bytes": 5_000_000,
                       "n_items": 500, "n_gpus": 1, "now": t + 1})
    assert m.plan("big", "c")["spare"] and not any(isinstance(e, EvictDataset) for e in effects)
    for job in ("a", "b", "c"):
        effects += m.apply({"type": "job_unregister", "job": job, "reason": "done", "now": t + 2})
    assert m.allocs["big"].spare and not any(isinstance(e, EvictDataset) for e in effects)  # grace period
    effects = m.apply({"type": "tick", "now": t + 2 + CFG.dataset_grace_s + 1})
    assert "big" not in m.datasets
    assert [e.dataset for e in effects if isinstance(e, EvictDataset)] == ["big"]


def test_no_chunks_keeps_its_incumbent_and_its_grace_period():
    """--no-chunks turns CHUNKED into NONE + spare holding budget: it must still get
    the incumbent's bonus, and keep its entries while a restarting job comes back."""
    from dataclasses import replace

    from manager.effects import EvictDataset
    from manager.policy import AllocConfig, Option, allocate
    from manager.policy.allocation import GB, DatasetDemand
    from manager.policy.probing import JobGain

    a_ds = DatasetDemand("A", 100 * GB, (JobGain("a", 1, 1 + 7.2 * 1.05),))      # FULL worth 7.56
    b_ds = DatasetDemand("B", 1000 * GB, tuple(JobGain(f"b{i}", 1, 3.0) for i in range(4)))  # chunks: 7.2
    for chunked in (True, False):  # B first holds the room; A, 5% more valuable, must not take it
        cfg = AllocConfig(chunked=chunked)
        current = {n: x.knapsack_option for n, x in allocate([b_ds], 100 * GB, cfg).items()}
        assert current == {"B": Option.CHUNKED}
        nxt = allocate([a_ds, b_ds], 100 * GB, cfg, current)
        assert nxt["A"].option is Option.NONE and nxt["B"].knapsack_option is Option.CHUNKED

    m = ManagerModel(replace(CFG, budget=250_000, alloc=AllocConfig(chunk_bytes=100_000, chunked=False,
                                                                          mechanism="chunks")))
    for job in ("x", "y"):
        m.apply({"type": "job_register", "job": job, "dataset": "big", "dataset_bytes": 1_000_000, "n_items": 100,
                 "n_gpus": 1, "now": 1000.0})
    a = m.allocs["big"]
    assert (a.option, a.spare, a.bytes, a.knapsack_option) == (Option.NONE, True, 200_000, Option.CHUNKED)
    effects = []
    for job in ("x", "y"):
        effects += m.apply({"type": "job_unregister", "job": job, "reason": "done", "now": 1001.0})
    assert m.allocs["big"].spare and m.allocs["big"].bytes > 0  # kept, and its budget with it
    assert not any(isinstance(e, EvictDataset) for e in effects)


def test_config_state_stays_readable_by_a_manager_from_before_no_chunks():
    from dataclasses import replace

    from manager.policy import AllocConfig

    d = ManagerConfig().to_dict()
    assert "chunked" not in d["alloc"]  # an older AllocConfig(**alloc) would refuse the key
    assert ManagerConfig.from_dict(d).alloc.chunked
    off = replace(ManagerConfig(), alloc=AllocConfig(chunked=False))
    assert ManagerConfig.from_dict(off.to_dict()).alloc.chunked is False
    assert "mechanism" not in d["alloc"] and ManagerConfig.from_dict(d).alloc.mechanism == "shares"
    chunks = replace(ManagerConfig(), alloc=AllocConfig(mechanism="chunks"))
    assert ManagerConfig.from_dict(chunks.to_dict()).alloc.mechanism == "chunks"


def test_batch_reports_are_journaled_without_an_fsync_of_their_own(tmp_path, monkeypatch):
    """A batch report is written at once (replayed after a restart) but not fsynced:
    the next fsynced event makes it durable; a registration is fsynced before it returns."""
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    store = StateStore(str(tmp_path), CFG, fsync=True).open()
    store.submit({"type": "job_register", "job": "j", "dataset": "d", "dataset_bytes": 10, "n_items": 1,
                  "n_gpus": 1})
    assert synced
    synced.clear()
    store.submit({"type": "batches", "job": "j", "batches": [[1000.0, 0.5, 1.0], [1000.5, 0.5, 0.0]]})
    assert synced == []
    digest = store.model.digest()
    for fd in (store._journal_fd, store._lock_fd):  # as kill -9: no snapshot, no close
        os.close(fd)
    store._journal_fd = store._lock_fd = None
    again = StateStore(str(tmp_path), CFG, fsync=False).open()
    assert again.model.digest() == digest  # the unsynced report was replayed
    again.close()


def test_a_job_that_leaves_during_its_probe_counts_the_probe_aborted():
    """Before: a job unregistered while its probe ran was counted in probes_started, never in
    probes_finished or probes_aborted (the metrics said a probe was still under way)."""
    from manager.policy.probing import Phase

    m = ManagerModel(CFG)
    m.apply({"type": "job_register", "job": "a", "dataset": "big", "dataset_bytes": 5_000_000, "n_items": 500,
             "n_gpus": 1, "now": 1000.0})
    t = 1000.0
    for _ in range(40):  # warm-up batches, then the first probe starts
        t += 0.1
        m.apply({"type": "batches", "job": "a", "now": t, "batches": [[t, 0.1, 1.0]]})
        m.apply({"type": "tick", "now": t})
        if m.board.jobs["a"].phase is Phase.PROBE_BYPASS:
            break
    assert m.board.jobs["a"].phase is Phase.PROBE_BYPASS and m.counters.get("probes_started") == 1
    m.apply({"type": "job_unregister", "job": "a", "reason": "done", "now": t + 0.1})
    c = m.counters
    assert c.get("probes_started", 0) == c.get("probes_finished", 0) + c.get("probes_aborted", 0) == 1
    assert ManagerModel.from_dict(m.to_dict()).counters == c
