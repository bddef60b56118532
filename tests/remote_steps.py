"""Steps for the remote-worker tests: module-level, importable by Ray's workers
(the test head puts tests/ on their path)."""
import random
import struct
import time

import numpy as np


def decode(data: bytes) -> np.ndarray:
    """Deterministic: the item's index and content as an array."""
    i = struct.unpack_from("<q", data)[0]
    return np.frombuffer(data, np.uint8).astype(np.int32) + i


class Slow:
    """Deterministic, taking `secs` per item (so a task is in flight when a worker dies)."""

    def __init__(self, secs: float) -> None:
        self.secs = secs

    def __call__(self, x):
        time.sleep(self.secs)
        return x * 2


class Jitter:
    """Random: the part of the pipeline the trainer runs after a hit."""
    random = True

    def __call__(self, x):
        return x + random.randint(0, 3)


def decode_wide(data: bytes) -> np.ndarray:
    """Another decode of the same bytes: the same files give the pipeline other inputs."""
    return np.frombuffer(data, np.uint8).astype(np.int32) * 1000


class Tint:
    """Random, but drawn alike every epoch (per_epoch=False): in the cacheable prefix,
    its output depends on the job's seed."""
    random = True
    per_epoch = False

    def __call__(self, x):
        return x + random.randint(0, 1 << 20)


def decode_entry(data: bytes, entry) -> np.ndarray:
    """A decode given the entry (its path, its target) besides the bytes."""
    return decode(data)


class HangElsewhere:
    """Deterministic; sleeps `secs` on items whose decode starts with one of `firsts`
    (remote_steps.decode: twice the index, for indices under 128), except in the process
    `home` (the test's own, where the trainer side makes the items it is left)."""

    def __init__(self, firsts, secs: float, home: int) -> None:
        self.firsts, self.secs, self.home = frozenset(firsts), secs, home

    def __call__(self, x):
        import os
        if os.getpid() != self.home and int(x[0]) in self.firsts:
            time.sleep(self.secs)
        return x * 2


class Gate:
    """Deterministic (x * 2); holds the items whose decode starts with one of `firsts`
    (2 * index, for indices under 128) while the file `flag` exists, at most `secs`: a
    remote task stays in flight for as long as a test wants, and ends when it says."""

    def __init__(self, firsts, flag: str, secs: float) -> None:
        self.firsts, self.flag, self.secs = frozenset(firsts), flag, secs

    def __call__(self, x):
        import os
        deadline = time.monotonic() + self.secs
        if int(x[0]) in self.firsts:
            while os.path.exists(self.flag) and time.monotonic() < deadline:
                time.sleep(0.05)
        return x * 2
