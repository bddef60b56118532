"""Seeds for random steps, derived from (job seed, epoch, item digest, step): the
same item in the same epoch of a job with the same seed draws the same numbers,
wherever it runs and wherever AutoOrder moved the step, so a random step's output
is reproducible and cacheable per seed."""
from __future__ import annotations

import contextlib
import hashlib
import random
import sys
import threading
import weakref
from collections.abc import Iterator


def item_seed(job_seed: int, epoch: int, digest: bytes, step: int) -> int:
    key = f"{job_seed}/{epoch}/{step}".encode()
    if len(key) > 64:  # blake2b keys stop at 64 bytes: hash a longer one whole (cutting it dropped epoch and step)
        key = hashlib.blake2b(key, digest_size=64, person=b"mlcache-seedkey").digest()
    h = hashlib.blake2b(digest, digest_size=8, key=key)
    return int.from_bytes(h.digest(), "little")


def seed_globals(seed: int) -> None:
    """Seed the generators steps draw from: random, numpy's global one and torch's
    (when torch is loaded)."""
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed & 0x7FFFFFFFFFFFFFFF)


def generator_states() -> dict[str, object]:
    """The states of the generators seed_globals seeds, comparable with ==: a step that
    draws from one of them changes its state."""
    out: dict[str, object] = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, key, *rest = np.random.get_state()
        out["numpy"] = (name, key.tobytes(), *rest)
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.get_rng_state().numpy().tobytes()
    return out


class Abandoned(RuntimeError):
    """Raised in a thread left behind (inline.InlineRunner) that goes on to a step: its
    result is thrown away, and it must not seed the generators again."""


class SeedLock:
    """One seeded random step at a time per process: the generators are global, so no
    other thread may re-seed them between a step's seeding and its draws. A holder whose
    thread was left behind after step_timeout (`fence`) loses the lock at once, so one
    stuck step blocks no other item's seeding; a fenced thread never takes it again."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._holder: threading.Thread | None = None
        self._taken = 0  # seeded steps begun, ever
        # fenced threads -> _taken when fenced, if the lock was taken from them then
        self._fenced: weakref.WeakKeyDictionary[threading.Thread, int | None] = weakref.WeakKeyDictionary()

    def acquire(self) -> threading.Thread:
        """Wait for the lock (raises Abandoned in a fenced thread); returns the holder."""
        me = threading.current_thread()
        with self._cond:
            while True:
                if me in self._fenced:
                    raise Abandoned(f"thread {me.name} was left behind after step_timeout: it runs no more steps")
                if self._holder is None:
                    self._holder = me
                    self._taken += 1
                    return me
                self._cond.wait()

    def release(self, holder: threading.Thread) -> int:
        """0; or, where the lock had been taken from `holder` (fenced during its step, which
        went on without it), how many seeded steps of other threads began since."""
        with self._cond:
            if self._holder is holder:
                self._holder = None
                self._cond.notify()
                return 0
            since = self._fenced.get(holder)
            return 0 if since is None else self._taken - since

    def fence(self, thread: threading.Thread) -> None:
        """`thread` was left behind: refuse it the lock from now on, and take the lock from
        it if it holds it."""
        with self._cond:
            took = self._holder is thread
            self._fenced[thread] = self._taken if took else None
            if took:
                self._holder = None
            self._cond.notify_all()  # a fenced waiter raises rather than wait on

    def fenced(self) -> bool:
        """Was this thread left behind?"""
        return len(self._fenced) > 0 and threading.current_thread() in self._fenced

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        holder = self.acquire()
        try:
            yield
        finally:
            self.release(holder)


SEEDING = SeedLock()  # the process's: every thread that seeds the generators takes it
