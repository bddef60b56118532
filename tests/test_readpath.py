"""The same-host read-path policy (cacheserver/client/readpath.py): pure, no servers."""
from cacheserver.client import readpath
from cacheserver.client.readpath import (LOCAL, MAX_HOLD, MIN_FOLLOWER_S, MIN_HOLD, REMOTE, ReadPaths, local_pays,
                                         writes_stopped, written_between)

MB = 1 << 20


def test_local_pays_compares_follower_cost_with_socket_cost_for_the_same_bytes():
    # The socket served 100 MB in 0.8 s (8 ms/MB).
    assert local_pays(0.05, 0.01, 25 * MB, 0.8, 100 * MB) is True      # 60 ms < 200 ms
    assert local_pays(1.2, 0.05, 25 * MB, 0.8, 100 * MB) is False      # 1.25 s > 200 ms
    assert local_pays(1.0, 0.0, 0, 0.8, 100 * MB) is False             # nothing served locally


def test_local_pays_assumes_a_fast_socket_until_one_is_measured():
    per_mb = readpath.PRIOR_REMOTE_S_PER_BYTE * MB
    assert local_pays(0.5 * per_mb * 10, 0.0, 10 * MB, 0.0, 0) is True
    assert local_pays(2.0 * per_mb * 10, 0.0, 10 * MB, 0.0, 0) is False
    # too few bytes measured: the prior, not the (slow) measurement
    assert local_pays(2.0 * per_mb * 10, 0.0, 10 * MB, 100.0, readpath.MIN_REMOTE_BYTES - 1) is False


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_cheap_catch_ups_never_end_a_window():
    p = ReadPaths(Clock())
    for _ in range(100):
        p.follower(MIN_FOLLOWER_S / 1000)
        p.local_read(0.001, 10 * MB)
        assert p.decide() == LOCAL
    assert p.stats.switches == 0


def test_costly_follower_switches_to_remote_holds_and_backs_off():
    clock = Clock()
    p = ReadPaths(clock)
    p.remote_read(0.8, 100 * MB)
    p.follower(1.2)
    p.local_read(0.01, 25 * MB)
    assert p.decide() == REMOTE and p.stats.switches == 1
    assert p.stats.follower_s == 0 and p.stats.remote_bytes == 50 * MB  # new window, halved estimate
    clock.t += MIN_HOLD - 0.1
    assert not p.use_local()
    clock.t += 0.2
    assert p.use_local() and p.state == LOCAL  # hold over: try the follower again
    p.follower(1.0)  # the reopen replays the log: it loses again
    assert p.decide() == REMOTE
    clock.t += MIN_HOLD + 0.1
    assert not p.use_local()  # the hold doubled
    clock.t += MIN_HOLD
    assert p.use_local()
    for _ in range(20):  # keeps doubling, up to MAX_HOLD
        p.follower(1.0)
        p.decide()
        clock.t += MAX_HOLD + 0.1
        assert p.use_local()


def test_a_paying_window_resets_the_hold():
    clock = Clock()
    p = ReadPaths(clock)
    p.remote_read(1.0, 10 * MB)
    p.follower(1.0)
    assert p.decide() == REMOTE
    clock.t += MIN_HOLD + 0.1
    assert p.use_local()
    p.follower(0.1)
    p.local_read(0.01, 100 * MB)  # the socket would have cost ~5 s for these
    assert p.decide() == LOCAL
    p.follower(1.0)
    assert p.decide() == REMOTE
    clock.t += MIN_HOLD + 0.1
    assert p.use_local()  # the hold went back to MIN_HOLD


def test_decide_waits_until_the_follower_has_cost_enough():
    p = ReadPaths(Clock())
    p.remote_read(1.0, 10 * MB)
    p.follower(MIN_FOLLOWER_S / 2)
    assert p.decide() == LOCAL and p.stats.follower_s > 0  # window still open


def test_written_between_counts_new_files_whole_and_growth_not_deletions():
    before = {"000010.log": 5 * MB, "000011.sst": 3 * MB, "000012.sst": 1 * MB}
    assert written_between(before, before) == 0
    assert written_between(before, {**before, "000010.log": 6 * MB}) == 1 * MB  # the log grew
    # a flush rotated the log and wrote a table file; a compaction merged two into one
    after = {"000013.log": 100, "000014.sst": 2 * MB, "000015.sst": 4 * MB}
    assert written_between(before, after) == 100 + 6 * MB
    assert written_between(after, {}) == 0  # all deleted: nothing to replay


def test_a_log_of_index_entries_alone_shows_writes():
    """--durability cache with large memtables: for seconds a put reaches the files only as
    its index entry in the log (~60 B); values wait in the memtable."""
    before = {"000010.log": 5 * MB, "000011.sst": 3 * MB}
    assert writes_stopped(before, before)
    assert writes_stopped(before, {**before, "000010.log": 5 * MB + 200})  # a few deletes, a mark
    assert not writes_stopped(before, {**before, "000010.log": 5 * MB + 30 * 60})  # 30 puts
    assert not writes_stopped(before, {**before, "000012.sst": 2 * MB})  # a flush or compaction
    assert writes_stopped(before, {"000013.log": 100, "000012.sst": 100_000})  # the last flush: log rotated


def test_remote_returns_to_local_early_once_the_server_stops_writing():
    clock = Clock()
    p = ReadPaths(clock)
    p.follower(1.0)
    assert p.decide() == REMOTE
    assert p.wants_files()
    files = {"000010.log": 50 * MB}
    assert not p.use_local(files)  # the first look only records the files
    clock.t += readpath.QUIET_CHECK / 2
    assert not p.wants_files()
    clock.t += readpath.QUIET_CHECK
    files = {"000010.log": 60 * MB}
    assert not p.use_local(files)  # still growing: 10 MB
    clock.t += readpath.QUIET_CHECK
    files = {"000011.log": 2 * MB, "000012.sst": 58 * MB}
    assert not p.use_local(files)  # rotated by a flush: 2 MB logged and a table file since
    clock.t += readpath.QUIET_CHECK
    assert p.use_local({**files, "000011.log": 2 * MB + 100})  # quiet, long before the hold ends
    assert p.state == LOCAL


def test_values_that_skip_the_log_still_count_as_writes():
    """--durability cache: the log grows by index entries only, while flushes and compactions
    write the table files a follower must open; REMOTE holds (it used to reopen every look)."""
    clock = Clock()
    p = ReadPaths(clock)
    p.follower(1.0)
    assert p.decide() == REMOTE
    files = {"000010.log": 500}
    for k in range(int(MIN_HOLD / readpath.QUIET_CHECK) - 2):
        assert not p.use_local(files)
        clock.t += readpath.QUIET_CHECK
        files = {**files, "000010.log": files["000010.log"] + 500, f"{20 + k:06d}.sst": 2 * MB}
    assert p.state == REMOTE


def test_catch_ups_are_spaced_by_their_cost():
    from cacheserver.client.localread import (CATCH_UP_SPACING, MAX_CATCH_UP_INTERVAL, MIN_CATCH_UP_INTERVAL,
                                       catch_up_interval)

    assert catch_up_interval(0.0) == MIN_CATCH_UP_INTERVAL  # cheap (values outside the log): soon
    assert catch_up_interval(0.01) == CATCH_UP_SPACING * 0.01
    assert catch_up_interval(1.0) == MAX_CATCH_UP_INTERVAL  # heavy log replay: rarely
