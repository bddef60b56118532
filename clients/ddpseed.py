"""DDP ranks that pass different seeds, found where they already meet: the key-value store of
torch.distributed's default process group.

Each rank's share of an epoch is its part of a permutation seeded by (seed, epoch)
(epochshare.py): ranks with different seeds split different permutations, so some items
are read twice in an epoch and others never, silently. A rank's sampler records its seed
in the store with one compare-and-set under a key that every rank makes alike for the same
loader: the dataset (its digest's fingerprint), the world size, the loader's own arguments
(`loader`: batch size, drop_last, ...) and, among this process's loaders equal in all of
them, the how-many-th it is, per torchrun restart. Creation order alone paired a rank's
train loader with another's val loader where ranks made them in another order (a false
"seeds differ", or a real mismatch missed); it now decides only between loaders that
differ in nothing but their seed. The first rank's value stays, and every later rank whose
seed differs raises, naming both. Nothing waits on another rank (no collective: ranks
that make their loaders at different times, or a rank that makes one the others do not,
cannot deadlock). Only the default group's own split is checked (rank and world size
equal to its): ranks given by hand may be a sub-group's (data-parallel ranks under tensor parallelism), whose groups
may differ legitimately. torch is looked up, never imported: a process that has not
imported torch.distributed has not initialised it.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

log = logging.getLogger("mlcache.client")
_made: dict[tuple[str, int, str], int] = {}  # samplers checked in this process, per (dataset, world size, args)


def _default_store(rank: int, world_size: int):
    """The default group's store when ranks (rank, world_size) are that group's, else None."""
    dist = sys.modules.get("torch.distributed")
    if world_size < 2 or dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    if (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):  # a torch without it: no check
        return None


def _args_key(loader: Mapping[str, object]) -> str:
    """The loader's arguments as one key part, alike on every rank whatever their order.
    Only plain values: a repr that holds an address (an object's) would differ per rank."""
    for name, value in loader.items():
        if not isinstance(name, str) or not isinstance(value, (bool, int, str)) or "/" in name + str(value):
            raise TypeError(f"loader arguments for the DDP seed check must be str, int or bool without "
                            f"'/'; got {name!r}={value!r}")
    return ",".join(f"{name}={loader[name]!r}" for name in sorted(loader))


def check_same_seed(dataset: str, seed: int, rank: int, world_size: int,
                    loader: Mapping[str, object] | None = None) -> None:
    """ValueError if another rank of this DDP job made its matching sampler with another seed.
    ``loader``: the arguments that tell this process's loaders of the dataset apart, the same
    on every rank for the same loader (not the seed or rank): batch_size, drop_last, ..."""
    args = _args_key(loader or {})
    store = _default_store(rank, world_size)
    if store is None:
        return
    k = _made.get((dataset, world_size, args), 0)
    _made[(dataset, world_size, args)] = k + 1
    # torchrun's restarted ranks join the same store (its agent's), which still holds the
    # last attempt's seeds: keyed by attempt, a run that passes another seed is no mismatch
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        first = store.compare_set(f"mlcache/seed/{attempt}/{dataset}/{world_size}/{args}/{k}", "", f"{seed}/{rank}")
        first_seed, first_rank = (int(x) for x in bytes(first).decode().split("/"))
    except Exception as e:  # a check only: the store's own trouble fails the job's collectives anyway
        log.debug("DDP seed check skipped: %s", e)
        return
    if first_seed != seed:
        what = f"dataset {dataset}" if dataset else "the dataset"
        raise ValueError(
            f"DDP ranks passed different seeds for {what}: rank {rank} seed={seed}, rank {first_rank} "
            f"seed={first_seed}. Every rank must pass the same seed: each takes its share of a "
            f"permutation seeded by it, and with different seeds the shares overlap (items read twice "
            f"in an epoch, others never)")
