"""WebDataset samples: the members of a tar shard that share a key, as one sample.

The rules are webdataset's own (webdataset.tariterators): a member ``dir/000123.jpg``
has key ``dir/000123`` and extension ``jpg`` (everything after the first dot of the
base name, lower-cased); consecutive members of a shard with the same key form one
sample ``{"__key__": key, "__url__": shard URL, ext: bytes, ...}``; members named
``__...__`` and names without an extension are skipped; an extension twice in one
sample is an error. Cache items stay per member: a sample is cached when all its
members are.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from .digest import Digest
from .digest_paths import listed_names, store_path

_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")
_PER_MEMBER = ": not WebDataset shards? pass samples=False for one item per member"


class SampleError(ValueError):
    """A shard cannot be grouped into samples; the message names the shard and member."""


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name by webdataset's rules; None when it is skipped."""
    if ("/" not in name and name.startswith("__") and name.endswith("__")) or _SKIP_META.match(name):
        return None
    m = _BASE_PLUS_EXT.match(name)
    return None if m is None else (m.group(1), m.group(2).lower())


class Samples:
    """Samples of a tar digest: sample ``s`` is items ``members[starts[s]:starts[s+1]]``."""

    def __init__(self, digest: Digest) -> None:
        if not digest.has_names:
            raise SampleError("this tar digest records no member names (it was made before digest format "
                              "version 2): re-create it with tools/digest to group WebDataset samples, "
                              "or pass samples=False for one item per member")
        self._names = digest  # keys are read back from it: fewer bytes to pickle into workers
        members: list[int] = []
        starts: list[int] = []
        codes: list[int] = []
        ext_code: dict[str, int] = {}
        last_path, last_key = -1, None
        for i in range(len(digest)):
            kx = split_name(digest.name(i))
            if kx is None:
                continue
            key, ext = kx
            path = int(digest.path_index[i])
            code = ext_code.setdefault(ext, len(ext_code))
            if path != last_path or key != last_key:
                starts.append(len(members))
                last_path, last_key = path, key
            elif code in codes[starts[-1]:]:
                raise SampleError(f"{digest.path(path)}: member {digest.name(i)!r} repeats extension "
                                  f"{ext!r} in sample {key!r}{_PER_MEMBER}")
            members.append(i)
            codes.append(code)
        if not members:
            raise SampleError(f"no member of {digest.root} has a WebDataset name (KEY.EXT){_PER_MEMBER}")
        starts.append(len(members))
        self.members = np.asarray(members, np.int64)
        self.starts = np.asarray(starts, np.int64)
        self.ext_names = list(ext_code)
        self.ext_codes = np.asarray(codes, np.uint16 if len(ext_code) < 65536 else np.uint32)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_names"] = None  # the dataset hands its digest back (rebind) after unpickling
        return state

    def rebind(self, digest: Digest) -> None:
        self._names = digest

    def key(self, s: int) -> str:
        """Sample s's key (from its first member's name)."""
        kx = split_name(self._names.name(self.first_member(s)))
        assert kx is not None  # members were chosen by having one
        return kx[0]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def flatten(self, samples: Sequence[int]) -> list[int]:
        """The member items of these samples, in order."""
        out: list[int] = []
        for s in samples:
            out.extend(self.members[self.starts[s]:self.starts[s + 1]].tolist())
        return out

    def assemble(self, digest: Digest, samples: Sequence[int], data: Sequence[bytes]) -> list[dict]:
        """Sample dicts from the bytes of flatten(samples), as webdataset yields them."""
        out, k = [], 0
        quoted = digest.root.startswith(("http://", "https://")) and not listed_names(digest.meta)
        for s in samples:
            a, b = int(self.starts[s]), int(self.starts[s + 1])
            first = int(self.members[a])
            url = store_path(digest.root, digest.location(first).path, quoted)
            d: dict = {"__key__": self.key(s), "__url__": url}
            for j in range(a, b):
                d[self.ext_names[self.ext_codes[j]]] = data[k]
                k += 1
            out.append(d)
        return out

    def combine_codes(self, samples: Sequence[int], codes: Sequence[int], hit: int, pending: int) -> list[int]:
        """A sample's look-up code from its members': a hit when all are; pending when
        the rest are being read by others; else a miss."""
        out, k = [], 0
        for s in samples:
            m = codes[k:k + int(self.starts[s + 1] - self.starts[s])]
            k += len(m)
            if all(c == hit for c in m):
                out.append(hit)
            elif all(c in (hit, pending) for c in m):
                out.append(pending)
            else:
                out.append(0)
        return out

    def first_member(self, s: int) -> int:
        return int(self.members[self.starts[s]])
