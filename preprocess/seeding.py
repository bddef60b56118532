"""Seeds for random steps, derived from (job seed, epoch, item digest, step): the
same item in the same epoch of a job with the same seed draws the same numbers,
wherever it runs and wherever AutoOrder moved the step, so a random step's output
is reproducible and cacheable per seed."""
from __future__ import annotations

import hashlib
import random
import sys


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
