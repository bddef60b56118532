"""A store whose open fails after RocksDB opened releases it, so that a retry in the same
process (the embedded default's: clients/embedded.py) gets the real error, or opens once
its cause is gone, instead of "lock hold by current process" named as damage."""
import os

import pytest
import rocksdict

from cacheserver.salvage import StoreDamaged, StoreUnopenable
from clients.embedded import EmbeddedCache

CAPACITY = 64 << 20


def _set_chunk_state(db_path: str, raw: bytes | None) -> None:
    """Write (None: delete) the server's saved chunk table straight into its RocksDB."""
    opts = rocksdict.Options(raw_mode=True)
    names = rocksdict.Rdict.list_cf(db_path, opts)
    db = rocksdict.Rdict(db_path, opts, column_families={n: rocksdict.Options(raw_mode=True)
                                                         for n in names if n != "default"})
    server = db.get_column_family("server")
    if raw is None:
        del server[b"chunks"]
    else:
        server[b"chunks"] = raw
    server.close()
    db.close()


def test_a_failed_embedded_open_releases_rocksdb_for_a_retry(tmp_path):
    cache_dir = str(tmp_path / "emb")
    cache = EmbeddedCache.shared(cache_dir, CAPACITY)
    key = os.urandom(32)
    assert cache.server.store.put_many([(key, b"hello")])[0] == 1
    cache.release()
    db_path = os.path.join(cache_dir, "db")
    _set_chunk_state(db_path, b"{not json")  # a damaged chunk table: the store's recovery raises

    for _ in range(2):  # before: the retry was refused as "the store is damaged ... lock hold by current process"
        with pytest.raises(ValueError) as err:
            EmbeddedCache.shared(cache_dir, CAPACITY)
        assert not isinstance(err.value, (StoreDamaged, StoreUnopenable)), err.value
        assert "lock" not in str(err.value)

    _set_chunk_state(db_path, None)  # this process can open RocksDB: nothing holds its LOCK
    cache = EmbeddedCache.shared(cache_dir, CAPACITY)  # and the cache opens once the cause is gone
    try:
        assert bytes(cache.server.store.get_many([key])[0]) == b"hello"
    finally:
        cache.release()
