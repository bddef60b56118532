"""The embedded default cache: `CachedDataset(..., cache=None)`.

A cache server running inside the training process (threads, not a daemon),
with its RocksDB under a local cache dir and a capacity. DataLoader worker
processes reach it through the same client as a real ring (Unix socket and
same-host direct reads), so a new user needs no server and the same code
scales to a ring by passing `cache="host:port,..."`.

Its records are plain (cacheserver/datadir.py): the items themselves, kept
intact by RocksDB's checksums, served only in this process and over an
owner-only Unix socket; a dir made before, of sealed records, stays sealed.
docs/security.md ("Encryption against oneself") gives the reasons and figures.
"""
from __future__ import annotations

import atexit
import base64
import os
import threading

from cacheserver import inproc
from cacheserver.datadir import records_format
from cacheserver.server import CacheServer, ServerConfig
from cacheserver.store import DataDirBusy

DEFAULT_CAPACITY = 10 * 2**30


def default_cache_dir() -> str:
    base = os.environ.get("MLCACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlcache")
    return os.path.join(base, "embedded")


class EmbeddedCacheBusy(RuntimeError):
    """Another process holds the embedded cache dir."""


class EmbeddedCache:
    _lock = threading.Lock()
    _open: dict[str, "EmbeddedCache"] = {}

    def __init__(self, cache_dir: str, capacity: int) -> None:
        os.makedirs(cache_dir, mode=0o700, exist_ok=True)
        self.plain = records_format(cache_dir) != "sealed"
        cfg = ServerConfig(listen="127.0.0.1:0", data_dir=cache_dir, capacity=capacity,
                           data_listen="auto", unix_socket="auto", grpc_workers=16, plain=self.plain,
                           # its datasets need no control operation: a token nobody holds keeps other
                           # local users from changing job modes or evicting over its loopback port
                           cluster_token=base64.b64encode(os.urandom(24)))
        try:
            self.server = CacheServer(cfg)
        except DataDirBusy as e:
            raise EmbeddedCacheBusy(
                f"embedded cache dir {cache_dir} is in use by another process; pass "
                f"cache_dir= to use another, or run a cacheserver and pass cache='host:port'") from e
        self.server.start()
        self.cache_dir = cache_dir
        self.capacity = capacity
        self.users = 0  # datasets holding it (shared): the last one to let go closes it
        self.address = self.server.address
        inproc.register(self.address, self.server.core)
        atexit.register(self.close)

    @classmethod
    def shared(cls, cache_dir: str | None = None, capacity: int = DEFAULT_CAPACITY) -> "EmbeddedCache":
        """One embedded server per cache dir and process, held until release()."""
        cache_dir = os.path.abspath(cache_dir or default_cache_dir())
        with cls._lock:
            cache = cls._open.get(cache_dir)
            if cache is None:
                cache = cls._open[cache_dir] = cls(cache_dir, capacity)
            elif cache.capacity != capacity:
                raise ValueError(f"embedded cache dir {cache_dir} is open in this process with a capacity of "
                                 f"{cache.capacity} bytes, and this dataset asks for {capacity}: pass the same "
                                 f"capacity, or another cache_dir")
            cache.users += 1
            return cache

    def release(self) -> None:
        """A dataset is done with it: the last of those that shared() it closes it."""
        with self._lock:
            self.users -= 1
            if self.users > 0:
                return
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._open.get(self.cache_dir) is self:
                del self._open[self.cache_dir]
            else:
                return
        inproc.unregister(self.address)
        self.server.stop(grace=2.0)
