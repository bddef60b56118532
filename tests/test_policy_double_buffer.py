import json
import re

import pytest

from manager.policy.double_buffer import (Activate, Assign, BufferConfig, ChunkState,
                                          DoubleBuffer, Evict, StartLoading, action_from_dict,
                                          action_to_dict)

DS = "ds"


def kinds(actions):
    return [type(a).__name__ for a in actions]


def evicts(actions):
    return [a for a in actions if isinstance(a, Evict)]


def warm(k=4, jobs=("A", "B"), cfg=None):
    """Buffer with chunk 0 ACTIVE, chunk 1 LOADING and ``jobs`` on chunk 0."""
    buf, acts = DoubleBuffer.create(DS, 1000, k, 0.0, cfg)
    assert acts == [StartLoading(DS, 0)]
    for j in jobs:
        assert buf.attach(j, 0.0)[0] == Assign(DS, j, 0)   # cold start: read the loading chunk
    acts = buf.loaded(0, 0.5, 1.0)
    assert acts == []
    acts = buf.loaded(0, 0.99, 2.0)
    assert acts == [Activate(DS, 0), StartLoading(DS, 1)]
    return buf


def check_invariants(buf):
    res = buf.resident()
    assert len(res) <= 2
    assert not (buf.loading is not None and buf.marked is not None)
    for j, s in buf.jobs.items():
        assert s.chunk is None or s.chunk in res, (j, s, res)
    if buf.k == 1:
        assert buf.marked is None


def test_create_and_cold_start():
    buf = warm()
    assert buf.state(0) is ChunkState.ACTIVE and buf.state(1) is ChunkState.LOADING
    assert buf.state(2) is ChunkState.EVICTED
    plan = buf.plan()
    assert (plan.active, plan.loading, plan.k, plan.n_items) == (0, 1, 4, 1000)
    check_invariants(buf)


def test_staggered_release_evicts_only_after_last_job():
    buf = warm()
    acts = buf.loaded(1, 1.0, 10.0)
    assert acts == [Activate(DS, 1)]                 # 0 is MARKED, both jobs still on it
    assert buf.state(0) is ChunkState.MARKED
    acts = buf.release("A", 0, 20.0)
    assert acts == [Assign(DS, "A", 1)]              # A moves to the newest active; no eviction
    assert buf.marked == 0
    assert buf.tick(25.0) == []
    acts = buf.release("B", 0, 30.0)
    assert acts == [Assign(DS, "B", 1), Evict(DS, 0, False, "all jobs released it"),
                    StartLoading(DS, 2)]
    check_invariants(buf)


def test_new_jobs_attach_to_newest_active():
    buf = warm()
    buf.loaded(1, 1.0, 10.0)
    assert buf.attach("C", 11.0) == [Assign(DS, "C", 1)]
    assert buf.readable("A") == [0] and buf.readable("C") == [1]
    assert buf.attach("C", 12.0) == [Assign(DS, "C", 1)]   # idempotent
    assert buf.readable("nobody") == []


def test_forced_eviction_of_straggler():
    cfg = BufferConfig(straggler_timeout_s=100.0)
    buf = warm(cfg=cfg)
    buf.loaded(1, 1.0, 10.0)
    buf.release("A", 0, 20.0)                      # first release of chunk 0 at t=20
    # the adaptive timeout is now 1.5 x median pass (20s -> 30s, clamped to >= 60s)
    assert buf.straggler_timeout() == 60.0
    assert buf.tick(79.0) == []
    acts = buf.tick(80.0)
    ev = evicts(acts)
    assert len(ev) == 1 and ev[0].forced and ev[0].chunk == 0 and "straggler: B" in ev[0].reason
    assert Assign(DS, "B", 1) in acts             # the straggler moves on to the active chunk
    assert StartLoading(DS, 2) in acts
    assert buf.release("B", 0, 81.0) == []        # its late release is stale
    check_invariants(buf)


def test_straggler_clock_starts_no_earlier_than_marking():
    buf = warm(cfg=BufferConfig(min_straggler_s=10, straggler_timeout_s=10))
    buf.release("A", 0, 5.0)                       # A finishes chunk 0 while it is ACTIVE
    assert buf.jobs["A"].chunk == 1               # -> the loading chunk (co-operative)
    buf.attach("C", 99.0)                          # late joiner on chunk 0
    buf.loaded(1, 1.0, 100.0)                      # 0 marked at t=100
    assert buf.tick(105.0) == []                   # 100s after A's release, but only 5s after marking
    assert evicts(buf.tick(110.0))[0].forced


def test_starving_job_forces_eviction_immediately():
    buf = warm()
    buf.loaded(1, 1.0, 10.0)
    buf.release("A", 0, 20.0)                      # A -> 1; B still on 0
    acts = buf.release("A", 1, 30.0)               # A done with 1 before B is done with 0
    ev = evicts(acts)
    assert ev and ev[0].forced and ev[0].chunk == 0 and "starvation" in ev[0].reason
    assert acts[-2:] == [StartLoading(DS, 2), Assign(DS, "A", 2)]
    assert buf.jobs["B"].chunk == 1                # B moved off the evicted chunk
    check_invariants(buf)
    # without the starvation rule, A waits instead
    buf2 = warm(cfg=BufferConfig(evict_on_starvation=False))
    buf2.loaded(1, 1.0, 10.0)
    buf2.release("A", 0, 20.0)
    assert buf2.release("A", 1, 30.0) == [Assign(DS, "A", None)]
    assert buf2.waiting() == ["A"]
    acts = buf2.release("B", 0, 40.0)
    assert Assign(DS, "A", 2) in acts              # the waiting job joins the new load


def test_job_waits_when_it_outruns_the_loader():
    buf = warm(jobs=("A",))
    acts = buf.release("A", 0, 5.0)
    assert acts == [Assign(DS, "A", 1)]            # onto the loading chunk
    assert buf.release("A", 1, 6.0) == [Assign(DS, "A", None)]
    acts = buf.loaded(1, 0.98, 7.0)
    # 1 active; 0 marked with no holders -> evicted at once; 2 starts loading and
    # A, which has already read all of 1, goes on to 2
    assert acts == [Activate(DS, 1), Evict(DS, 0, False, "all jobs released it"),
                    StartLoading(DS, 2), Assign(DS, "A", 2)]


def test_cold_start_job_that_finished_the_loading_chunk_is_not_sent_back():
    buf, _ = DoubleBuffer.create(DS, 100, 3, 0.0)
    buf.attach("A", 0.0)
    assert buf.release("A", 0, 5.0) == [Assign(DS, "A", None)]   # read all of chunk 0 while loading
    acts = buf.loaded(0, 1.0, 6.0)
    assert acts == [Activate(DS, 0), StartLoading(DS, 1), Assign(DS, "A", 1)]
    assert buf.attach("B", 7.0) == [Assign(DS, "B", 0)]
    check_invariants(buf)


def test_cycles_through_all_chunks():
    k = 5
    buf = warm(k=k, jobs=("A", "B", "C"))
    now = 2.0
    activated, evicted = [0], []
    for _ in range(3 * k):
        now += 10
        acts = buf.loaded(buf.loading, 1.0, now)
        activated += [a.chunk for a in acts if isinstance(a, Activate)]
        for j in ("A", "B", "C"):                  # staggered passes
            now += 1
            chunk = buf.jobs[j].chunk
            if chunk is not None and chunk == buf.marked:
                acts = buf.release(j, chunk, now)
                evicted += [a.chunk for a in evicts(acts)]
                assert not any(a.forced for a in evicts(acts))
        check_invariants(buf)
    assert activated == [i % k for i in range(len(activated))]
    assert evicted == [i % k for i in range(len(evicted))]
    assert len(activated) >= 3 * k


def test_full_dataset_single_chunk_never_evicts():
    buf, acts = DoubleBuffer.create(DS, 500, 1, 0.0)
    assert acts == [StartLoading(DS, 0)]
    buf.attach("A", 0.0)
    assert buf.release("A", 0, 1.0) == [Assign(DS, "A", 0)]   # cold pass over: next epoch, same chunk
    assert buf.loaded(0, 1.0, 2.0) == [Activate(DS, 0)]
    for t in range(3, 50):
        acts = buf.release("A", 0, float(t)) + buf.tick(t + 1e6)
        assert acts == [Assign(DS, "A", 0)]
    buf.detach("A", 60.0)
    assert buf.tick(1e9) == [] and buf.resident() == [0]


def test_two_chunks_alternate():
    buf = warm(k=2, jobs=("A",))
    for i in range(6):
        cur = buf.jobs["A"].chunk
        acts = buf.loaded(buf.loading, 1.0, 10.0 * i + 5)
        acts += buf.release("A", cur, 10.0 * i + 6)
        assert [a.chunk for a in evicts(acts)] == [cur]
        check_invariants(buf)


def test_preloading_pauses_without_jobs_and_resumes():
    buf = warm(jobs=("A",))
    buf.detach("A", 3.0)
    acts = buf.loaded(1, 1.0, 4.0)
    assert acts == [Activate(DS, 1), Evict(DS, 0, False, "all jobs released it")]
    assert buf.loading is None                     # nobody reads: do not churn the store
    acts = buf.attach("B", 5.0)
    assert acts == [Assign(DS, "B", 1), StartLoading(DS, 2)]


def test_detach_releases_and_stale_events_are_ignored():
    buf = warm()
    buf.loaded(1, 1.0, 10.0)
    assert buf.detach("ghost", 11.0) == []
    buf.detach("A", 11.0)
    acts = buf.detach("B", 12.0)
    assert evicts(acts) == [Evict(DS, 0, False, "all jobs released it")]
    assert buf.loaded(3, 1.0, 13.0) == []          # not the loading chunk: stale
    assert buf.release("A", 1, 13.0) == []         # unknown job
    with pytest.raises(ValueError):
        buf.release("A", 9, 13.0)
    with pytest.raises(ValueError):
        DoubleBuffer.create(DS, 10, 0, 0.0)


def test_max_marked_cap_for_dead_jobs():
    buf = warm(cfg=BufferConfig(max_marked_s=300))
    buf.loaded(1, 1.0, 10.0)                       # nobody ever releases chunk 0
    assert buf.tick(309.0) == []
    ev = evicts(buf.tick(310.0))
    assert ev[0].forced and "max_marked_s" in ev[0].reason


def test_serialise_restore_midway_is_identical():
    buf = warm(k=6, jobs=("A", "B", "C"))
    buf.loaded(1, 1.0, 10.0)
    buf.release("A", 0, 11.0)
    buf.attach("D", 12.0)
    buf.loaded(1, 0.3, 13.0)
    snap = json.loads(json.dumps(buf.to_dict()))
    restored = DoubleBuffer.from_dict(snap)
    assert restored == buf and restored.to_dict() == buf.to_dict()

    script = [("release", "B", 0, 20.0), ("tick", 700.0), ("release", "A", 1, 701.0),
              ("loaded", 2, 0.99, 702.0), ("release", "D", 1, 703.0), ("detach", "C", 704.0),
              ("tick", 2000.0)]

    def play(b):
        out = []
        for ev in script:
            if ev[0] == "release":
                out += b.release(*ev[1:])
            elif ev[0] == "loaded":
                out += b.loaded(*ev[1:])
            elif ev[0] == "detach":
                out += b.detach(*ev[1:])
            else:
                out += b.tick(ev[1])
        return out

    a1, a2 = play(buf), play(restored)
    assert a1 == a2 and a1
    assert restored == buf
    # actions themselves round-trip through JSON for the daemon's journal
    for a in a1:
        assert action_from_dict(json.loads(json.dumps(action_to_dict(a)))) == a


@pytest.mark.parametrize("seed", range(5))
def test_random_event_sequences_keep_invariants_and_restore_exactly(seed):
    import random
    rng = random.Random(seed)
    k = rng.choice([1, 2, 3, 5, 8])
    buf, _ = DoubleBuffer.create(DS, 10_000, k, 0.0, BufferConfig(straggler_timeout_s=50))
    now, pool = 0.0, [f"j{i}" for i in range(6)]
    for step in range(400):
        now += rng.uniform(0, 5)
        ev = rng.random()
        job = rng.choice(pool)
        if ev < 0.15:
            acts = buf.attach(job, now)
        elif ev < 0.2:
            acts = buf.detach(job, now)
        elif ev < 0.6:
            chunk = buf.jobs[job].chunk if job in buf.jobs and buf.jobs[job].chunk is not None \
                else rng.randrange(k)
            acts = buf.release(job, chunk, now)
        elif ev < 0.85:
            acts = buf.loaded(buf.loading if buf.loading is not None else rng.randrange(k),
                              rng.choice([0.5, 0.99, 1.0]), now)
        else:
            acts = buf.tick(now)
        check_invariants(buf)
        for a in acts:
            assert action_from_dict(action_to_dict(a)) == a
            if isinstance(a, Evict) and not a.forced:
                assert k > 1
        if step % 37 == 0:
            restored = DoubleBuffer.from_dict(json.loads(json.dumps(buf.to_dict())))
            assert restored == buf
            buf = restored


# ---------------------------------------------------------------- configuration checks

@pytest.mark.parametrize("field, value, allowed", [
    ("pass_history", 0, "[1, 1000]"), ("pass_history", -1, "[1, 1000]"), ("pass_history", 1001, "[1, 1000]"),
    ("pass_history", 2.0, "[1, 1000]"), ("pass_history", True, "[1, 1000]"),
    ("load_threshold", 0.0, "(0, 1]"), ("load_threshold", 1.01, "(0, 1]"), ("load_threshold", float("nan"), "(0, 1]"),
    ("straggler_timeout_s", 0.0, "> 0"), ("straggler_timeout_s", float("inf"), "> 0"),
    ("straggler_factor", -1.5, "> 0"), ("straggler_factor", "1.5", "> 0"),
    ("min_straggler_s", -1.0, ">= 0"), ("max_straggler_s", 0.0, "> 0"),
    ("max_marked_s", 0.0, "> 0"), ("max_marked_s", float("nan"), "> 0"),
    ("evict_on_starvation", "yes", "true or false"),
])
def test_buffer_config_refuses_values_out_of_range_naming_the_field(field, value, allowed):
    with pytest.raises(ValueError, match=rf"{field} must be .*{re.escape(allowed)}") as e:
        BufferConfig(**{field: value}).check()
    assert e.value.field == field


def test_buffer_config_refuses_a_max_below_the_min_and_takes_the_edges():
    with pytest.raises(ValueError, match=r"min_straggler_s must be <= max_straggler_s"):
        BufferConfig(min_straggler_s=100.0, max_straggler_s=10.0).check()
    BufferConfig(load_threshold=1.0, min_straggler_s=0.0, max_straggler_s=0.5, pass_history=1, max_marked_s=0.1).check()
    BufferConfig(pass_history=1000, min_straggler_s=60, max_straggler_s=60).check()


def test_a_pass_history_of_one_keeps_one_pass():
    """(pass_history 0 was taken before the check: ``del passes[:-0]`` deletes nothing, and
    the journaled list grew with every release.)"""
    buf = warm(cfg=BufferConfig(pass_history=1))
    buf.release("A", 0, 20.0)
    buf.release("B", 0, 30.0)
    assert len(buf.passes) == 1


def test_a_buffer_journaled_with_a_config_now_refused_still_loads_and_keeps_one_pass():
    """States written before the checks hold configs they refuse (pass_history 0): the
    manager must still open them, and pass_history 0 keeps one pass, not every one."""
    buf = warm()
    d = json.loads(json.dumps(buf.to_dict()))
    d["config"]["pass_history"] = 0
    old = DoubleBuffer.from_dict(d)
    old.release("A", 0, 20.0)
    old.release("B", 0, 30.0)
    assert len(old.passes) == 1
