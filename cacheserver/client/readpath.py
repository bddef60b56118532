"""Which same-host read path pays: the follower (local) or the socket (remote).

Reading values straight from the server's files (localread.py) costs almost
nothing per byte, but the follower must replay *every* write the server made
since it last caught up, whether or not this client ever reads those values.
Under a read-mostly load that is free. While jobs insert heavily (a partial
cache, co-operative misses) each job's follower replays all inserts and
serves few of them: in tools/bench/partial, 1.2 s of catch-up per job bought
25 MB of local reads that the socket served at ~8 ms/MB. So the client
measures both paths and keeps the follower only while it pays. (With the
default --durability cache, values skip the log: the follower replays only
the small index entries and sees values once the server flushes them, but it
still opens every table file the flushes and compactions made: catching up
with a small store under heavy inserts took ~0.1 s in tools/bench/partial.)

States, per server client (ReadPaths):

  LOCAL   gets ask the server which ids are present and read them from the
          follower; values it cannot see yet are fetched over the socket
          (which also measures the socket's cost per byte).
  REMOTE  gets go over the socket; the follower is dropped, so nothing is
          replayed.

  LOCAL  -> LOCAL   a window ends (the follower cost MIN_FOLLOWER_S) and
                    local_pays(): counters restart, hold back to MIN_HOLD
  LOCAL  -> REMOTE  a window ends and the socket would have been cheaper;
                    stay remote for `hold` seconds, then double it (to
                    MAX_HOLD) in case the next try loses again
  REMOTE -> LOCAL   the hold is over, or the writes stopped (writes_stopped()):
                    in QUIET_CHECK seconds the server wrote less than
                    QUIET_BYTES to its log, table and blob files, and less
                    than QUIET_LOG_BYTES to its log (the client stats them:
                    localread.written_files). A follower replays the log's
                    growth and opens the table files that flushes and
                    compactions made; blob files, of values it never reads,
                    count because their flushes make table files of index
                    entries. Bytes alone miss writes with --durability cache:
                    values skip the log (the client reopened a follower every
                    QUIET_CHECK under the heaviest inserts when only the log
                    counted: 0.1-0.4 s of RocksDB work each in
                    tools/bench/partial's lru run, most of the jobs' CPU) and
                    wait in memtables of up to 64 MiB, so for seconds only
                    their index entries, ~60 B a put, reach the files.
                    Reopen the follower; its opening counts as follower cost.

The policy itself, local_pays(), is a pure function of the measured costs.

Opening a follower first asks the server to flush (OPEN_FOLLOWER). A server that answers
"busy" (--max-connections, --max-inflight-bytes) or does not answer in time refused only
for now: the open is tried again after a back-off (OpenRetry) that doubles, from
RETRY_FIRST_S to RETRY_MAX_S, while it keeps failing, so a busy server is not asked on
every get (so is an open that could not make its scratch dir: scratch.py, or that RocksDB
could not open for now: no fd left, a MANIFEST rolled over meanwhile); a follower RocksDB
can never open (no permission, another version's store, the data dir gone: follower.lasting)
is never tried again. The open runs
in a thread of its own, holding no lock through the ask or RocksDB's open: the get that
finds it due and the others go over the socket meanwhile, so a server that does not answer
costs a get one request timeout, not the open's as well (follower.py).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

MIN_FOLLOWER_S = 0.05  # decide once the follower has cost this much wall time
MIN_REMOTE_BYTES = 1 << 20  # below this the socket's cost per byte is not measured yet...
PRIOR_REMOTE_S_PER_BYTE = 1e-9  # ...so assume 1 GB/s (tools/bench/hitpath: Unix socket, idle host)
QUIET_CHECK = 0.25  # seconds between looks at the server's files while REMOTE
QUIET_BYTES = 1 << 20  # bytes written per look below which the writes count as stopped...
# ...and bytes of log: with --durability cache a put logs only its index entry (~60 B) and its
# value waits in the memtable (up to 64 MiB, diskbudget.lsm_sizes), unseen, until a flush
QUIET_LOG_BYTES = 1 << 10
MIN_HOLD = 5.0  # while the writes go on, each reopen starts another losing window: not too often
MAX_HOLD = 60.0
RETRY_FIRST_S = 0.5  # a follower's open that the server refused for now: tried again after this...
RETRY_MAX_S = 30.0  # ...doubled at each refusal in a row, up to this

LOCAL, REMOTE = "local", "remote"


def local_pays(follower_s: float, local_read_s: float, local_bytes: int,
               remote_s: float, remote_bytes: int) -> bool:
    """True if the follower (catch-ups + reads) cost no more than the socket
    would have for the same bytes."""
    per_byte = remote_s / remote_bytes if remote_bytes >= MIN_REMOTE_BYTES else PRIOR_REMOTE_S_PER_BYTE
    return follower_s + local_read_s <= local_bytes * per_byte


def written_between(before: Mapping[str, int], now: Mapping[str, int]) -> int:
    """Bytes the server wrote between two looks at its log, table and blob files (name ->
    size): files new since whole, grown ones by their growth; deleted ones add nothing."""
    return sum(size - before.get(name, 0) for name, size in now.items() if size > before.get(name, 0))


def writes_stopped(before: Mapping[str, int], now: Mapping[str, int]) -> bool:
    """Whether the server's files (name -> size) show no more writes between two looks:
    fewer than QUIET_BYTES in all, and fewer than QUIET_LOG_BYTES of log (~17 puts)."""
    logged = written_between({n: k for n, k in before.items() if n.endswith(".log")},
                             {n: k for n, k in now.items() if n.endswith(".log")})
    return logged < QUIET_LOG_BYTES and written_between(before, now) < QUIET_BYTES


@dataclass
class PathStats:
    follower_s: float = 0.0  # opening the follower and catching up
    local_read_s: float = 0.0
    local_bytes: int = 0
    remote_s: float = 0.0
    remote_bytes: int = 0
    switches: int = 0  # LOCAL -> REMOTE transitions so far


class ReadPaths:
    """The LOCAL/REMOTE state machine above; thread-safe."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.state = LOCAL
        self.stats = PathStats()
        self._hold = MIN_HOLD
        self._until = 0.0
        self._files: Mapping[str, int] | None = None  # the server's files at the last look
        self._finished: dict[str, int] = {}  # of those, the ones the look before saw at the same size
        self._looked_at = 0.0

    @property
    def files_finished(self) -> Mapping[str, int]:
        """The server's files that kept their size over the last two looks: RocksDB writes a
        table file under its final name, so a look may catch one half-written, and only
        one that stopped growing is done (localread.written_files reuses their sizes)."""
        return self._finished

    def wants_files(self) -> bool:
        """Whether the next use_local() should be given the server's files (localread.written_files)."""
        return self.state == REMOTE and self._clock() - self._looked_at >= QUIET_CHECK

    def use_local(self, files: Mapping[str, int] | None = None) -> bool:
        """Whether this get should try the follower (REMOTE -> LOCAL, see above)."""
        with self._lock:
            if self.state == REMOTE:
                now = self._clock()
                if now >= self._until:
                    self.state = LOCAL
                elif files is not None and now - self._looked_at >= QUIET_CHECK:
                    last, self._files, self._looked_at = self._files, files, now
                    self._finished = {} if last is None else {n: k for n, k in files.items() if last.get(n) == k}
                    if last is not None and writes_stopped(last, files):
                        self.state = LOCAL
            return self.state == LOCAL

    def follower(self, seconds: float) -> None:
        with self._lock:
            self.stats.follower_s += seconds

    def local_read(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.stats.local_read_s += seconds
            self.stats.local_bytes += nbytes

    def remote_read(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.stats.remote_s += seconds
            self.stats.remote_bytes += nbytes

    def decide(self) -> str:
        """End the window if the follower has cost enough; returns the state to use."""
        with self._lock:
            s = self.stats
            if self.state != LOCAL or s.follower_s < MIN_FOLLOWER_S:
                return self.state
            if local_pays(s.follower_s, s.local_read_s, s.local_bytes, s.remote_s, s.remote_bytes):
                self._hold = MIN_HOLD
            else:
                self.state = REMOTE
                self._files, self._finished, self._looked_at = None, {}, 0.0
                self._until = self._clock() + self._hold
                self._hold = min(self._hold * 2, MAX_HOLD)
                s.switches += 1
            # A new window; the socket's cost is kept, halved, as a running estimate.
            s.follower_s = s.local_read_s = 0.0
            s.local_bytes = 0
            s.remote_s /= 2
            s.remote_bytes //= 2
            return self.state


class OpenRetry:
    """When to try again to open a follower whose open failed for now (see above); thread-safe."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._wait = 0.0  # the back-off after the last refusal; 0: none in a row
        self._at = 0.0
        self.refusals = 0  # in all, for stats and tests

    def due(self) -> bool:
        return self._clock() >= self._at

    def refused(self) -> float:
        """An open failed for now: the seconds until the next try."""
        with self._lock:
            self._wait = min(RETRY_MAX_S, max(RETRY_FIRST_S, 2 * self._wait))
            self._at = self._clock() + self._wait
            self.refusals += 1
            return self._wait

    def opened(self) -> None:
        with self._lock:
            self._wait, self._at = 0.0, 0.0
