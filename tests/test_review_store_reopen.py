"""A store whose open fails after RocksDB opened releases it, so that a retry in the same
process (the embedded default's: clients/embedded.py) gets the real error, or opens once
its cause is gone, instead of "lock hold by current process" named as damage."""
import contextlib
import os
from collections.abc import Iterator

import pytest
import rocksdict

from cacheserver.salvage import StoreDamaged, StoreUnopenable
from cacheserver.storerecovery import Recovery
from clients.embedded import EmbeddedCache

CAPACITY = 64 << 20


@contextlib.contextmanager
def raw_store(db_path: str) -> Iterator[rocksdict.Rdict]:
    """The store's RocksDB opened directly (the store closed), every column family raw."""
    opts = rocksdict.Options(raw_mode=True)
    names = rocksdict.Rdict.list_cf(db_path, opts)
    db = rocksdict.Rdict(db_path, opts, column_families={n: rocksdict.Options(raw_mode=True)
                                                         for n in names if n != "default"})
    try:
        yield db
    finally:
        db.close()


def set_server_state(db_path: str, key: bytes, raw: bytes | None) -> None:
    """Write (None: delete) one record of the server-wide state straight into the store's RocksDB."""
    with raw_store(db_path) as db:
        server = db.get_column_family("server")
        if raw is None:
            del server[key]
        else:
            server[key] = raw
        server.close()


def test_a_failed_embedded_open_releases_rocksdb_for_a_retry(tmp_path, monkeypatch):
    cache_dir = str(tmp_path / "emb")
    cache = EmbeddedCache.shared(cache_dir, CAPACITY)
    key = os.urandom(32)
    assert cache.server.store.put_many([(key, b"hello")])[0] == 1
    cache.release()

    def failing(self, check_all=False):  # the store's recovery raises once RocksDB is open
        raise ValueError("recovery failed (injected)")

    with monkeypatch.context() as m:  # (a damaged chunk table did this once; now it is dropped)
        m.setattr(Recovery, "_recover", failing)
        for _ in range(2):  # before: the retry was refused as "the store is damaged ... lock hold by current process"
            with pytest.raises(ValueError) as err:
                EmbeddedCache.shared(cache_dir, CAPACITY)
            assert not isinstance(err.value, (StoreDamaged, StoreUnopenable)), err.value
            assert "lock" not in str(err.value) and "injected" in str(err.value)

    # the cause gone: this process can open RocksDB, nothing holds its LOCK
    cache = EmbeddedCache.shared(cache_dir, CAPACITY)  # and the cache opens once the cause is gone
    try:
        assert bytes(cache.server.store.get_many([key])[0]) == b"hello"
    finally:
        cache.release()
