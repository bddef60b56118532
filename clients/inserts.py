"""A dataset's misses into the cache: sealed (or, for a plain store, as they are), grouped by
the chunk the plan puts them in, and put; and the claims of those no server's store took,
given up.

A miss read from the store was checked against the digest there (storeread.py), so what is
put is known good: its sealed value is remembered in the loader's table of checked values
(checked.py) and, in the embedded process, vouched for. A put that reaches no store (skipped:
the plan gives the item no space; refused before the store: busy, or over the server's size
limits; its server down) leaves the item uncached, as a full cache would; the job's claims on
such items are given up (cacheserver/claims.py) so the jobs told to WAIT read them at once.
"""
from __future__ import annotations

import logging
from typing import Any

from cacheserver import inproc
from cacheserver.client.server_client import ClientClosed, RecordsMismatch

from . import capability, checked
from .procstate import ProcessState

log = logging.getLogger("clients.dataset")
_warned: set[str] = set()  # what this process has warned about
PUT_BYTES = 64 << 20  # a put's values at most: a quarter of a server's default --max-batch-size


def insert(ds: Any, st: ProcessState, entries: list[tuple[int, bytes, bool]],
           unput: list[int] | None = None) -> int:
    """Seal and insert `ds`'s (index, item, replace) entries; returns how many reached a
    server's store (the `inserted` counter: not those refused for their size, nor skipped).
    `unput` gets the positions of entries that reached no server's store: skipped,
    refused before the store, or their server down."""
    if not ds.insert or st.ring is None or not entries:
        return 0
    groups: dict[tuple[int, bool], list[int]] = {}  # positions in entries, per (chunk, replace)
    sealed: dict[int, tuple[bytes, capability.Buffer]] = {}  # position in entries -> (id, value)
    for k, (i, item, was_poisoned) in enumerate(entries):
        chunk = ds.plan.insert_chunk(i)
        if chunk is None:  # the manager gives this part of the dataset no cache space now
            if unput is not None:
                unput.append(k)
            continue
        # read_items checked the item against the digest (its BLAKE3 or SHA-256).
        sealed[k] = capability.stored(item, ds.digest.sha256(i), ds.plain_records)
        groups.setdefault((chunk, was_poisoned), []).append(k)
    if st.checked is not None and sealed:  # sealed from checked items: known when read back as these bytes
        expected = ds.expected_hashes([entries[k][0] for k in sealed])
        st.checked.remember([checked.key(ident, e) for (ident, _), e in zip(sealed.values(), expected)],
                            [value for _, value in sealed.values()])
    reached = len(sealed)
    for (chunk, replace), ks in groups.items():
        missed = put_group(ds, st, [sealed[k] for k in ks], chunk, replace)
        reached -= len(missed)
        if unput is not None:
            unput.extend(ks[m] for m in missed)
    return reached


def put_group(ds: Any, st: ProcessState, items: list, chunk: int, replace: bool) -> list[int]:
    """Put sealed items under one chunk, in puts of at most PUT_BYTES, or of a server's
    smaller --max-batch-size (a batch of large items would pass it, refused whole); the
    positions of those no server's store took."""
    sizes = [len(v) for _, v in items]
    # the embedded server's own item limit is known: an item over it stays out (a server's, only it knows)
    limit = st.core.limits.max_item_bytes if st.core is not None else None
    missed = [p for p, z in enumerate(sizes) if limit is not None and z > limit]
    if missed:
        _warn_once("item over the limit", f"{len(missed)} items over the embedded cache's item limit "
                                          f"({limit} bytes) stay uncached")
    fit = [p for p, z in enumerate(sizes) if limit is None or z <= limit]
    for part in split_by_bytes(fit, sizes, batch_bytes(st.ring, PUT_BYTES, st.core)):
        missed += [part[m] for m in _put_part(ds, st, [items[p] for p in part], chunk, replace)]
    return missed


def batch_bytes(ring: Any, most: int, core: Any = None) -> int:
    """`most`, or less where a server takes less: the embedded server's (`core`, in this
    process) --max-batch-size, else the smallest one `ring`'s servers announce. A put of
    more is refused whole, and a get's answer past it is cut (the rest answered as misses)."""
    if core is not None:
        return min(most, core.limits.max_batch_bytes)
    known = ring.batch_limit() if ring is not None else None  # None: no cache, or no server heard yet
    return min(most, known) if known else most


def split_by_bytes(positions: list[int], sizes: list[int], limit: int) -> list[list[int]]:
    """`positions` (into `sizes`) in runs whose sizes total at most `limit` (an item larger
    than that alone)."""
    out: list[list[int]] = []
    size = limit + 1
    for p in positions:
        n = sizes[p]
        if size + n > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def _put_part(ds: Any, st: ProcessState, items: list, chunk: int, replace: bool) -> list[int]:
    """One put; the positions of the items no server's store took."""
    if st.core is None:
        unsent: list[int] = []
        try:
            st.ring.put(items, ds.job, ds.dataset_tag, chunk, replace=replace, unsent=unsent)
        except RecordsMismatch:  # the wrong server for this cache's records, not a refusal
            raise
        except ClientClosed:  # the dataset closed under this batch (another thread): not a refusal
            return list(range(len(items)))
        except ValueError as e:  # refused whole (over its --max-item-size or --max-batch-size):
            # not cached, as a full cache; training goes on from the store
            _warn_once("put refused", f"a cache server refused a put of {len(items)} items, "
                                      f"which stay uncached: {e}")
            return list(range(len(items)))
        return unsent
    try:  # sealed from checked items: the in-process server vouches for them (a plain one needs not)
        inproc.put(st.core, ds.job, items, ds.dataset_tag, chunk, replace, vouch=not ds.plain_records)
    except ValueError:  # a malformed put: ours to fix, not the store's
        raise
    except Exception as e:  # RocksDB failed the write: as the ring takes a failed server, a miss
        log.warning("embedded cache refused a put of %d items: %s", len(items), e)
        return list(range(len(items)))
    return []


def give_up(ds: Any, st: ProcessState, ids: list[bytes]) -> None:
    """Release `ds`'s job's claims on misses it will not insert: the jobs told WAIT for them
    read them at once instead of waiting out the claims' ttl (cacheserver/claims.py).
    Best effort: a server that does not answer keeps them until then."""
    if not ids:
        return
    try:
        st.ring.release(ids, ds.job)
    except Exception as e:  # never in the way of the batch, nor of the error being raised
        log.debug("could not release %d claims: %s", len(ids), e)


def _warn_once(what: str, message: str) -> None:
    """Log `message` the first time `what` comes up in this process (not once per batch)."""
    if what not in _warned:
        _warned.add(what)
        log.warning("%s (said once per process)", message)
