"""Steps for the autocache tests: module-level, so spawned workers can import them."""
import os
import time

import numpy as np


def as_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).astype(np.float32)


class Scale:
    def __init__(self, f: float) -> None:
        self.f = f

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x * self.f


def scale_two(x: np.ndarray) -> np.ndarray:
    return x * 2


def scale_two_v2(x: np.ndarray) -> np.ndarray:  # the same effect, other code: another key
    return x + x


class Slow:
    def __init__(self, secs: float) -> None:
        self.secs = secs

    def __call__(self, x):
        time.sleep(self.secs)
        return x


def shrink(x: np.ndarray) -> np.ndarray:
    return x[:16].copy()


def noise(x: np.ndarray) -> np.ndarray:
    """Random: declare it with step(noise, random=True)."""
    return x + np.random.rand(*x.shape).astype(np.float32)


def jitter(x: np.ndarray) -> np.ndarray:
    """Random but not declared so: the determinism check catches it."""
    return x + np.random.rand(*x.shape).astype(np.float32)


def double_in_place(x: np.ndarray) -> np.ndarray:
    x *= 2
    return x


def total(x: np.ndarray) -> float:
    return float(x.sum())


def blow_up(x: np.ndarray) -> np.ndarray:
    """2 MiB from a few KiB at almost no CPU (the zeros are mapped lazily): dearer to put
    and read back than to remake."""
    y = np.zeros(1 << 18, dtype=np.float64)
    y[0] = x[0]
    return y


def head(x: np.ndarray) -> float:
    return float(x[0])


def as_object(x):
    """An output the transformed-item format cannot store."""
    return {"x": x, "o": object}


def pick_x(d):
    return d["x"]


def urandom_noise(x: np.ndarray) -> np.ndarray:
    """Random from the OS, not from the seeded generators: never reproducible."""
    return x + np.frombuffer(os.urandom(x.size), np.uint8).astype(np.float32)
