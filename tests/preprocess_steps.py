"""Steps for the preprocess integration tests: module-level, so spawned workers can
import them (tests/ is on their path through the pickled module name)."""
import multiprocessing
import os
import struct
import time

SLOW = set()


def index_of(data: bytes) -> int:
    return struct.unpack_from("<q", data)[0]


class SleepOn:
    """Sleeps `secs` on the given indices (in `parts` steps, so the item can move to
    the background between them)."""

    def __init__(self, indices, secs):
        self.indices, self.secs = frozenset(indices), secs

    def __call__(self, i):
        if i in self.indices:
            time.sleep(self.secs)
        return i


class FailOn:
    def __init__(self, every):
        self.every = every

    def __call__(self, i):
        if i % self.every == 0:
            raise ValueError(f"bad item {i}")
        return i


def pad(i):
    return (i, bytes(100))


def first(x):
    return x[0]


def index_mod3(entry):
    """A target= function of the item's Entry."""
    return entry.index % 3


def as_tensor(i):
    """A torch tensor (passed to the scheduler through shared memory, as DataLoader's)."""
    import torch
    return torch.full((4,), i)


class KillOn:
    """Kills its own worker process (SIGKILL) on the given indices."""

    def __init__(self, indices):
        self.indices = frozenset(indices)

    def __call__(self, i):
        if i in self.indices:
            import os
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def inflate_mib(i):
    """An output of 1 MiB (bytes), as an inflating step makes."""
    return bytes([i % 256]) * (1 << 20)


def with_values(i):
    """(index, 64 floats): the index travels with the data, so a later step can tell items apart."""
    import numpy as np
    return (i, np.full(64, float(i)))


def scale_values(item):
    return (item[0], item[1] * 2)


class HalveBut:
    """Halves the values of every item but the given ones (neutral on those, deflating on the rest)."""

    def __init__(self, indices):
        self.indices = frozenset(indices)

    def __call__(self, item):
        i, v = item
        return item if i in self.indices else (i, v[::2])


class HangOn:
    """Sleeps `secs` on the given indices (a step stuck on an item: the stall tests), only
    in pool workers unless `everywhere` (not while the loader profiles the sample in-process)."""

    def __init__(self, indices, secs, everywhere=False):
        self.indices, self.secs, self.everywhere = frozenset(indices), secs, everywhere

    def __call__(self, i):
        import multiprocessing
        here = self.everywhere or multiprocessing.current_process().name.startswith("preprocess-")
        if here and i in self.indices:
            time.sleep(self.secs)
        return i


def in_worker() -> bool:
    return multiprocessing.current_process().name.startswith("preprocess-")


class MoveSlow:
    """Slow on one item in the pool's workers: over the first timeout (the sample's items take
    microseconds), it moves to the background."""

    def __init__(self, slow, secs=0.05):
        self.slow, self.secs = slow, secs

    def __call__(self, i):
        if i == self.slow and in_worker():
            time.sleep(self.secs)
        return i


class SleepOnce:
    """Sleeps `secs` on one item the first time a worker runs it (a marker file says it did)."""

    def __init__(self, item, marker, secs):
        self.item, self.marker, self.secs = item, marker, secs

    def __call__(self, i):
        if i == self.item and in_worker() and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            time.sleep(self.secs)
        return i


class KillWhile:
    """Kills its own worker process (SIGKILL) on any item while a marker file exists: workers
    that die only once the test says so (in a later epoch, say)."""

    def __init__(self, marker):
        self.marker = marker

    def __call__(self, i):
        if in_worker() and os.path.exists(self.marker):
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        return i


class SleepOutsideWorkers:
    """Sleeps `secs` on every item outside the pool's workers: the sample profiled in the
    loader's process then sets a first slow-item timeout of about `secs`, so items fast in
    the workers stay in their main thread however loaded the machine is."""

    def __init__(self, secs):
        self.secs = secs

    def __call__(self, i):
        if not in_worker():
            time.sleep(self.secs)
        return i


def _unpickled_slowly(i, secs):
    time.sleep(secs)
    return i


class SlowToUnpickle(int):
    """An int whose unpickling takes `secs`: in the loader's process it holds up the thread
    reading the workers' results (as a large output, or the GIL held elsewhere, would). It
    unpickles to a plain int."""

    def __new__(cls, i, secs):
        obj = super().__new__(cls, i)
        obj.secs = secs
        return obj

    def __reduce__(self):
        return (_unpickled_slowly, (int(self), self.secs))


class HoldUpLoaderOn:
    """In the pool's workers, item `item`'s output is a SlowToUnpickle(secs)."""

    def __init__(self, item, secs):
        self.item, self.secs = item, secs

    def __call__(self, i):
        return SlowToUnpickle(i, self.secs) if i == self.item and in_worker() else i
