"""Chunked double-buffering with two-step eviction (Quiver section 5.1), as an
explicit per-dataset state machine.

Inputs are events with a ``now`` float; outputs are lists of actions for the
daemon to carry out (tell servers / clients, start a preload, evict). No I/O,
no clocks. The whole state round-trips through a JSON-compatible dict so the
daemon can journal it and restore it exactly after a crash.

Chunk states (at most two chunks resident: LOADING+ACTIVE or ACTIVE+MARKED)::

    EVICTED --start loading--> LOADING --loaded >= threshold--> ACTIVE
    ACTIVE  --next chunk becomes ACTIVE--> MARKED --all holders released-------> EVICTED
                                           MARKED --straggler timeout / starving--> EVICTED (forced)

A job is always on one chunk (reading its share of its epoch from it with
substitutable hits) or *waiting* (chunk None: nothing newer is readable yet;
the client reads its pending items straight from the store).

Transitions, by event:

``create(dataset, n_items, k, now)``
    chunk 0 -> LOADING; emits StartLoading(0). Jobs attaching before it is
    loaded read it with co-operative misses (cold start).
``attach(job, now)``
    job -> newest ACTIVE chunk (the LOADING one during cold start); emits
    Assign. Idempotent. May restart preloading that was paused for lack of jobs.
``loaded(chunk, fraction, now)``  (fraction of the LOADING chunk resident)
    if fraction >= load_threshold: LOADING -> ACTIVE (emits Activate), the old
    ACTIVE -> MARKED (its holders keep reading it; new jobs only get the new
    one), waiting jobs -> new ACTIVE (unless they just finished that very
    chunk: cold start). Reports for any other chunk are stale and ignored.
``release(job, chunk, now)``  (job finished its pass over ``chunk``)
    job moves on: from MARKED -> the ACTIVE chunk; from ACTIVE -> the LOADING
    chunk (co-operative misses help load it) or, if none, waiting; from
    LOADING -> waiting. With k == 1 (FULL) the job stays on chunk 0 (next
    epoch). Records the pass time and the chunk's first release. A release of
    a chunk the job is not on is stale and ignored (at-least-once delivery).
    Starvation: if a job would wait while a MARKED chunk blocks the next
    preload, the MARKED chunk is force-evicted at once (``evict_on_starvation``).
``detach(job, now)``
    job leaves (finished / died); releases whatever it held.
``tick(now)``
    MARKED chunk force-evicted when ``straggler_timeout`` has passed since the
    FIRST release of that chunk (counted from the marking if that came later),
    or ``max_marked_s`` since it was marked.
    Stragglers on it are moved to the ACTIVE chunk (their unread items stay
    pending in their client and are read later).
after every event (``_progress``)
    MARKED with no holders -> EVICTED (emits Evict(forced=False)); then if
    k >= 2, nothing LOADING or MARKED and some job attached: the next chunk in
    cyclic order -> LOADING (emits StartLoading); waiting jobs -> it.

Better than the paper: the straggler timeout adapts to this dataset's observed
pass times (``straggler_factor`` x median, clamped), instead of one global
constant; starving fast jobs trigger eviction immediately instead of idling
until the timeout; preloading pauses when no job reads the dataset; events are
idempotent so replays after a crash are harmless.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Mapping, Union

from .chunks import ChunkPlan


class ChunkState(str, Enum):
    EVICTED = "evicted"   # not resident (also: never loaded)
    LOADING = "loading"
    ACTIVE = "active"
    MARKED = "marked"


class ConfigFieldError(ValueError):
    """A configuration value out of its range; ``field`` names it (for the flag or file
    it came from, managerd.py)."""

    def __init__(self, field: str, message: str, also: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.field = field
        self.fields = (field, *also)  # every field the refusal involves


MAX_PASS_HISTORY = 1000  # pass times kept per dataset are journaled: keep the state small


def _number(name: str, v: Any, low: float, high: float = math.inf, low_open: bool = False) -> None:
    """``v`` a finite number in [low, high] (``low_open``: (low, high]); else a ConfigFieldError."""
    if (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and (v > low if low_open else v >= low) and v <= high):
        return
    if math.isfinite(high):
        allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    else:
        allowed = f"{'>' if low_open else '>='} {low:g}"
    raise ConfigFieldError(name, f"buffer config: {name} must be a finite number {allowed}, got {v!r}")


@dataclass(frozen=True)
class BufferConfig:
    """Thresholds of the double buffer. check() refuses a value out of its range (a
    ConfigFieldError, a ValueError, names the field and the range) where a config enters
    the manager (flags, ``--policy-config``: managerd.py); construction does not, so a
    state journaled before those checks still opens (its values are clamped where used,
    and the flags' config, checked, replaces it as a ``configure`` event)."""
    load_threshold: float = 0.98        # fraction resident that counts as loaded, in (0, 1]
    straggler_timeout_s: float = 600.0  # used until pass times have been observed; > 0
    straggler_factor: float = 1.5       # x median pass time, see tick(); > 0
    min_straggler_s: float = 60.0       # >= 0
    max_straggler_s: float = 3600.0     # >= min_straggler_s
    evict_on_starvation: bool = True
    max_marked_s: float | None = None   # hard cap on MARKED lifetime (dead jobs); None: off, else > 0
    pass_history: int = 16              # pass times kept for the median, 1..MAX_PASS_HISTORY

    def check(self) -> "BufferConfig":
        """This config, if every field is in range; else a ConfigFieldError."""
        _number("load_threshold", self.load_threshold, 0.0, 1.0, low_open=True)
        _number("straggler_timeout_s", self.straggler_timeout_s, 0.0, low_open=True)
        _number("straggler_factor", self.straggler_factor, 0.0, low_open=True)
        _number("min_straggler_s", self.min_straggler_s, 0.0)
        _number("max_straggler_s", self.max_straggler_s, 0.0, low_open=True)
        if self.max_straggler_s < self.min_straggler_s:  # the min is the one flags set
            raise ConfigFieldError("min_straggler_s", f"buffer config: min_straggler_s must be <= max_straggler_s "
                                                      f"({self.max_straggler_s!r}), got {self.min_straggler_s!r}",
                                   also=("max_straggler_s",))
        if not isinstance(self.evict_on_starvation, bool):
            raise ConfigFieldError("evict_on_starvation", f"buffer config: evict_on_starvation must be true or "
                                                          f"false, got {self.evict_on_starvation!r}")
        if self.max_marked_s is not None:
            _number("max_marked_s", self.max_marked_s, 0.0, low_open=True)
        if not isinstance(self.pass_history, int) or isinstance(self.pass_history, bool) \
                or not 1 <= self.pass_history <= MAX_PASS_HISTORY:
            raise ConfigFieldError("pass_history", f"buffer config: pass_history must be an integer in "
                                                   f"[1, {MAX_PASS_HISTORY}], got {self.pass_history!r}")
        return self


# ---------------------------------------------------------------- actions

@dataclass(frozen=True)
class StartLoading:
    dataset: str
    chunk: int
    kind: str = "start_loading"


@dataclass(frozen=True)
class Activate:
    """Tell servers the dataset's active chunk (what new jobs read)."""
    dataset: str
    chunk: int
    kind: str = "activate"


@dataclass(frozen=True)
class Evict:
    dataset: str
    chunk: int
    forced: bool
    reason: str
    kind: str = "evict"


@dataclass(frozen=True)
class Assign:
    """Tell a job's client which chunk to read (None: wait; read pending items
    from the store)."""
    dataset: str
    job: str
    chunk: int | None
    kind: str = "assign"


Action = Union[StartLoading, Activate, Evict, Assign]
_ACTIONS = {c.kind: c for c in (StartLoading, Activate, Evict, Assign)}  # type: ignore[attr-defined]


def action_to_dict(a: Action) -> dict[str, Any]:
    return asdict(a)


def action_from_dict(d: Mapping[str, Any]) -> Action:
    return _ACTIONS[d["kind"]](**d)


# ---------------------------------------------------------------- state

@dataclass
class JobSlot:
    chunk: int | None       # None: waiting
    since: float            # when it started its pass over ``chunk``
    last: int | None = None  # chunk it finished most recently (never handed back to it at once)


@dataclass
class DoubleBuffer:
    dataset: str
    n_items: int
    k: int
    config: BufferConfig = field(default_factory=BufferConfig)
    active: int | None = None
    loading: int | None = None
    marked: int | None = None
    loaded_fraction: float = 0.0
    marked_at: float | None = None
    first_release: dict[int, float] = field(default_factory=dict)  # resident chunk -> time
    jobs: dict[str, JobSlot] = field(default_factory=dict)
    passes: list[float] = field(default_factory=list)  # recent pass durations
    cursor: int = -1      # last chunk that started loading
    version: int = 0

    @classmethod
    def create(cls, dataset: str, n_items: int, k: int, now: float,
               config: BufferConfig | None = None) -> tuple["DoubleBuffer", list[Action]]:
        if k < 1 or n_items < 0:
            raise ValueError(f"need k >= 1 and n_items >= 0, got k={k}, n_items={n_items}")
        buf = cls(dataset, n_items, k, config or BufferConfig())
        return buf, buf._start_loading(0, now)

    # -- queries
    def state(self, chunk: int) -> ChunkState:
        if chunk == self.active:
            return ChunkState.ACTIVE
        if chunk == self.loading:
            return ChunkState.LOADING
        if chunk == self.marked:
            return ChunkState.MARKED
        return ChunkState.EVICTED

    def resident(self) -> list[int]:
        return sorted(c for c in (self.active, self.loading, self.marked) if c is not None)

    def holders(self, chunk: int) -> list[str]:
        return sorted(j for j, s in self.jobs.items() if s.chunk == chunk)

    def waiting(self) -> list[str]:
        return sorted(j for j, s in self.jobs.items() if s.chunk is None)

    def readable(self, job: str) -> list[int]:
        """Chunks the job may read now (its current chunk, or none if waiting/unknown)."""
        s = self.jobs.get(job)
        return [] if s is None or s.chunk is None else [s.chunk]

    def plan(self) -> ChunkPlan:
        return ChunkPlan(self.dataset, self.n_items, self.k, self.active, self.loading, self.version)

    def straggler_timeout(self) -> float:
        c = self.config
        if not self.passes:
            return c.straggler_timeout_s
        s = sorted(self.passes)
        n = len(s)
        med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
        return min(c.max_straggler_s, max(c.min_straggler_s, c.straggler_factor * med))

    # -- internal steps
    def _check_chunk(self, chunk: int) -> None:
        if not 0 <= chunk < self.k:
            raise ValueError(f"{self.dataset}: chunk {chunk} out of range for k={self.k}")

    def _assign(self, job: str, chunk: int | None, now: float, last: int | None = None) -> Assign:
        prev = self.jobs.get(job)
        keep = last if last is not None else (prev.last if prev is not None else None)
        self.jobs[job] = JobSlot(chunk, now, keep)
        return Assign(self.dataset, job, chunk)

    def _wake(self, chunk: int, now: float) -> list[Action]:
        """Waiting jobs -> ``chunk``, except one that has just finished it."""
        return [self._assign(j, chunk, now) for j in self.waiting() if self.jobs[j].last != chunk]

    def _start_loading(self, chunk: int, now: float) -> list[Action]:
        self.loading, self.loaded_fraction, self.cursor = chunk, 0.0, chunk
        self.first_release.pop(chunk, None)
        self.version += 1
        out: list[Action] = [StartLoading(self.dataset, chunk)]
        # waiting jobs help load it (co-operative misses) rather than idle
        return out + self._wake(chunk, now)

    def _evict(self, chunk: int, forced: bool, reason: str, now: float) -> list[Action]:
        assert chunk == self.marked
        self.marked, self.marked_at = None, None
        self.first_release.pop(chunk, None)
        self.version += 1
        out: list[Action] = [Evict(self.dataset, chunk, forced, reason)]
        for j in self.holders(chunk):  # stragglers (forced only): move to the newest
            out.append(self._assign(j, self.active, now))
        return out

    def _next_chunk(self) -> int | None:
        for step in range(1, self.k + 1):
            c = (self.cursor + step) % self.k
            if c not in (self.active, self.loading, self.marked):
                return c
        return None

    def _progress(self, now: float) -> list[Action]:
        out: list[Action] = []
        if self.marked is not None and not self.holders(self.marked):
            out += self._evict(self.marked, False, "all jobs released it", now)
        if (self.k >= 2 and self.loading is None and self.marked is None
                and self.active is not None and self.jobs):
            nxt = self._next_chunk()
            if nxt is not None:
                out += self._start_loading(nxt, now)
        return out

    def _promote(self, now: float) -> list[Action]:
        old, new = self.active, self.loading
        assert new is not None
        self.active, self.loading, self.loaded_fraction = new, None, 0.0
        self.version += 1
        out: list[Action] = [Activate(self.dataset, new)]
        if old is not None:
            self.marked, self.marked_at = old, now
        out += self._wake(new, now)
        return out + self._progress(now)

    # -- events
    def attach(self, job: str, now: float) -> list[Action]:
        s = self.jobs.get(job)
        if s is not None:
            return [Assign(self.dataset, job, s.chunk)]
        target = self.active if self.active is not None else self.loading
        return [self._assign(job, target, now)] + self._progress(now)

    def detach(self, job: str, now: float) -> list[Action]:
        if self.jobs.pop(job, None) is None:
            return []
        return self._progress(now)

    def loaded(self, chunk: int, fraction: float, now: float) -> list[Action]:
        self._check_chunk(chunk)
        if chunk != self.loading:
            return []  # stale progress report
        self.loaded_fraction = max(self.loaded_fraction, float(fraction))
        if self.loaded_fraction >= self.config.load_threshold:
            return self._promote(now)
        return []

    def release(self, job: str, chunk: int, now: float) -> list[Action]:
        self._check_chunk(chunk)
        s = self.jobs.get(job)
        if s is None or s.chunk != chunk:
            return []  # stale or duplicate
        self.passes.append(max(0.0, now - s.since))
        del self.passes[:-max(1, int(self.config.pass_history))]  # at least one: [:-0] would keep all
        self.first_release.setdefault(chunk, now)
        out: list[Action] = []
        if self.k == 1:
            return [self._assign(job, chunk, now, last=chunk)]
        if chunk == self.marked:
            target = self.active
        elif chunk == self.active:
            target = self.loading
        else:  # the LOADING chunk: nothing newer exists yet
            target = None
        out.append(self._assign(job, target, now, last=chunk))
        if (target is None and self.marked is not None and self.config.evict_on_starvation
                and self.loading is None):
            out += self._evict(self.marked, True, f"starvation: job {job} has nothing new to read", now)
        return out + self._progress(now)

    def tick(self, now: float) -> list[Action]:
        if self.marked is None:
            return []
        first = self.first_release.get(self.marked)
        timeout = self.straggler_timeout()
        # The clock starts at the first release (paper) but not before the chunk
        # was marked: until then it blocks nothing, and jobs that attached just
        # before the marking deserve a whole pass.
        t0 = None if first is None else max(first, self.marked_at if self.marked_at is not None else first)
        if t0 is not None and now - t0 >= timeout:
            why = (f"straggler: {', '.join(self.holders(self.marked))} still on it "
                   f"{now - t0:.0f}s after the first release (timeout {timeout:.0f}s)")
        elif (self.config.max_marked_s is not None and self.marked_at is not None
              and now - self.marked_at >= self.config.max_marked_s):
            why = f"marked for {now - self.marked_at:.0f}s (max_marked_s)"
        else:
            return []
        return self._evict(self.marked, True, why, now) + self._progress(now)

    # -- persistence
    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset, "n_items": self.n_items, "k": self.k,
            "config": asdict(self.config),
            "active": self.active, "loading": self.loading, "marked": self.marked,
            "loaded_fraction": self.loaded_fraction, "marked_at": self.marked_at,
            # JSON object keys must be strings
            "first_release": {str(c): t for c, t in sorted(self.first_release.items())},
            "jobs": {j: {"chunk": s.chunk, "since": s.since, "last": s.last}
                     for j, s in sorted(self.jobs.items())},
            "passes": list(self.passes), "cursor": self.cursor, "version": self.version,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DoubleBuffer":
        def opt(v: Any) -> int | None:
            return None if v is None else int(v)
        return cls(
            dataset=str(d["dataset"]), n_items=int(d["n_items"]), k=int(d["k"]),
            config=BufferConfig(**d.get("config", {})),
            active=opt(d.get("active")), loading=opt(d.get("loading")), marked=opt(d.get("marked")),
            loaded_fraction=float(d.get("loaded_fraction", 0.0)),
            marked_at=None if d.get("marked_at") is None else float(d["marked_at"]),
            first_release={int(c): float(t) for c, t in d.get("first_release", {}).items()},
            jobs={j: JobSlot(opt(s["chunk"]), float(s["since"]), opt(s.get("last")))
                  for j, s in d.get("jobs", {}).items()},
            passes=[float(x) for x in d.get("passes", [])],
            cursor=int(d.get("cursor", -1)), version=int(d.get("version", 0)),
        )

