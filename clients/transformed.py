"""Get and put the transformed items of one (dataset, transform prefix) on a ring.

The one place that turns source capabilities into transformed items in the cache
and back: keys from clients/derived.py, payload bytes from preprocess/codec.py.
Used by the loaders (autocache) and by remote preprocessing workers alike, so a
worker's put is a trainer's hit.

Transformed items are inserted under their own dataset name,
`transformed_tag(dataset_tag, fingerprint)`, so the manager can count their bytes
and benefit against the dataset's budget apart from its source items."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cacheserver.client.ring_client import RingClient
from cacheserver.client.server_client import RecordsMismatch
from cacheserver.vocab import transformed_tag
from preprocess.codec import CodecError, decode, encode
from preprocess.fingerprint import Uncacheable

from . import inserts
from .capability import PoisonedValue
from .derived import derived_id, derived_key, open_derived, open_plain_derived, plain_derived, seal_derived

log = logging.getLogger("clients.transformed")
MAX_PAYLOAD = 1 << 30  # a value this large is refused on read: no dataset item is
MAX_GET_ROUNDS = 64  # gets of a batch's ids a server cut from its answer, at most (_get_uncut)
__all__ = ["MAX_PAYLOAD", "TransformedCounts", "TransformedItems", "transformed_tag"]


@dataclass
class TransformedCounts:
    hits: int = 0
    misses: int = 0
    poisoned: int = 0  # failed authentication or decoding: treated as a miss and replaced
    inserted: int = 0
    bytes_read: int = 0
    bytes_put: int = 0
    uncacheable: list[str] = field(default_factory=list)  # first reasons an output could not be encoded
    refused: int = 0  # puts a server refused whole (their items over its size limits)


class TransformedItems:
    """Transformed items of one dataset under one prefix fingerprint (and seed)."""

    def __init__(self, ring: RingClient, job: str, dataset_tag: str, fingerprint: str,
                 seed: int | None = None) -> None:
        self.ring, self.job, self.fingerprint, self.seed = ring, job, fingerprint, seed
        self.tag = transformed_tag(dataset_tag, fingerprint)
        self.counts = TransformedCounts()
        # the ring is a plain embedded cache (cacheserver/datadir.py): payloads stored as they are
        plain = getattr(ring, "plain", False)
        self._open, self._seal = (open_plain_derived, plain_derived) if plain else (open_derived, seal_derived)

    def key(self, K: bytes) -> bytes:
        return derived_key(K, self.fingerprint, self.seed)

    def ids(self, Ks: Sequence[bytes]) -> list[bytes]:
        return [derived_id(self.key(K)) for K in Ks]

    def lookup(self, Ks: Sequence[bytes]) -> list[bool]:
        return self.ring.lookup(self.ids(Ks), self.job)

    def get(self, Ks: Sequence[bytes], poisoned: list[int] | None = None) -> list[Any | None]:
        """The transformed item per source key K, None where absent or poisoned
        (poisoned ones are counted, and their positions appended to `poisoned`: put
        them again with replace=True)."""
        keys = [self.key(K) for K in Ks]
        values = self._get_uncut([derived_id(k) for k in keys])
        out: list[Any | None] = [None] * len(keys)
        c = self.counts
        for j, (k, v) in enumerate(zip(keys, values)):
            if v is None:
                c.misses += 1
                continue
            try:
                out[j] = decode(self._open(k, v, MAX_PAYLOAD))
            except (PoisonedValue, CodecError):
                c.poisoned += 1
                c.misses += 1
                if poisoned is not None:
                    poisoned.append(j)
                continue
            c.hits += 1
            c.bytes_read += len(v)
        return out

    def _get_uncut(self, ids: list[bytes]) -> list[Any]:
        """ring.get, asking again for the ids answered as misses while an answer was large: a
        server answers the ids past its --max-batch-size as misses (getbound.py), and unlike a
        digest's items, transformed items' sizes are not known to ask in parts. Puts go in
        parts within every server's limit (put_payloads), so an answer a server cut holds over
        half of such a part (unless the next item alone is larger); a smaller answer's misses
        are misses."""
        values = answer = self.ring.get(ids, self.job)
        for _ in range(MAX_GET_ROUNDS):
            rest = [j for j, v in enumerate(values) if v is None]
            if not rest or sum(len(v) for v in answer if v is not None) <= self._part_bytes() // 2:
                break
            answer = self.ring.get([ids[j] for j in rest], self.job)
            for j, v in zip(rest, answer):
                values[j] = v
        return values

    def put(self, Ks: Sequence[bytes], items: Sequence[Any], chunk: int = 0, replace: bool = False) -> int:
        """Encode, seal and insert; an item the codec cannot store is skipped (its reason
        kept in counts.uncacheable). Returns how many were newly stored."""
        kept = [(K, p) for K, p in zip(Ks, map(self.encode, items)) if p is not None]
        return self.put_payloads([K for K, _ in kept], [p for _, p in kept], chunk, replace)

    def encode(self, item: Any) -> bytes | None:
        """The payload of an item, None (its reason kept in counts.uncacheable) where
        the format cannot store it. Encoding copies: the item may change afterwards."""
        try:
            return encode(item)
        except Uncacheable as e:
            if len(self.counts.uncacheable) < 10:
                self.counts.uncacheable.append(str(e))
            return None

    def put_payloads(self, Ks: Sequence[bytes], payloads: Sequence[bytes], chunk: int = 0,
                     replace: bool = False) -> int:
        """put() of items encoded already (encode()); returns how many were newly stored.
        Put in parts of at most inserts.PUT_BYTES, or a server's smaller --max-batch-size: a
        batch of large items would pass it and be refused whole, uncached every epoch."""
        batch = []
        for K, payload in zip(Ks, payloads):
            sealed = self._seal(self.key(K), payload)
            batch.append((sealed.id, sealed.value))
        sizes = [len(v) for _, v in batch]
        parts = inserts.split_by_bytes(list(range(len(batch))), sizes, self._part_bytes())
        return sum(self._put_part([batch[p] for p in part], chunk, replace) for part in parts)

    def _part_bytes(self) -> int:
        """The most bytes a put sends: inserts.PUT_BYTES, or less where a server takes less."""
        return inserts.batch_bytes(self.ring, inserts.PUT_BYTES)

    def _put_part(self, batch: list[tuple[bytes, Any]], chunk: int, replace: bool) -> int:
        """One put; how many it newly stored (0 where refused: those stay uncached)."""
        try:
            stored = self.ring.put(batch, self.job, self.tag, chunk, replace=replace)
        except RecordsMismatch:  # the wrong server for this cache's records, not a refusal
            raise
        except ValueError as e:  # refused whole (over a server's --max-item-size or --max-batch-size):
            # uncached, as by a full cache; the loader goes on with the items it made
            self._refused(f"a cache server refused a put of {len(batch)} transformed items: {e}")
            return 0
        self.counts.inserted += stored
        self.counts.bytes_put += sum(len(v) for _, v in batch)
        return stored

    def _refused(self, why: str) -> None:
        if not self.counts.refused:
            log.warning("%s; they stay uncached (said once per dataset and prefix)", why)
        self.counts.refused += 1
