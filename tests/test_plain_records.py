"""Plain records (cacheserver/datadir.py): a store that keeps values as they are, its dir
marked so; RocksDB's checksums catch a damaged value in the LSM and in blob files alike,
and neither kind of store opens a dir of the other."""
import glob
import os

import pytest

from cacheserver.counters import Counters
from cacheserver.datadir import PlaintextDir, records_format
from cacheserver.eviction import make_policy
from cacheserver.store import Store


def store(path, plain: bool) -> Store:
    return Store(str(path), 1 << 30, make_policy("lru"), Counters(), plain=plain)


@pytest.mark.parametrize("size", [100 << 10, 400 << 10], ids=["lsm", "blob"])
def test_a_flipped_bit_on_disk_is_dropped_not_served(tmp_path, size):
    st = store(tmp_path, plain=True)
    try:
        good, other = os.urandom(size), os.urandom(size)
        st.put_many([(b"a" * 32, good), (b"b" * 32, other)])
        st.flush()
        got = st.get_many([b"a" * 32, b"b" * 32])
        assert got == [good, other] and type(got[0]) is bytes  # the item itself: no trailer, no copy
        files = glob.glob(os.path.join(st.db_path, "*.sst")) + glob.glob(os.path.join(st.db_path, "*.blob"))
        hits = [(f, data.find(good[1000:1032])) for f in files for data in [open(f, "rb").read()]
                if good[1000:1032] in data]
        assert len(hits) == 1
        with open(hits[0][0], "r+b") as f:
            f.seek(hits[0][1])
            f.write(bytes([good[1000] ^ 0x01]))
        assert st.get_many([b"a" * 32]) == [None]
        assert st.counters.snapshot()["corrupt_dropped"] == 1
        assert st.get_many([b"a" * 32]) == [None] and st.items == 1  # dropped from the index too
    finally:
        st.close()


def test_each_kind_of_store_refuses_the_other_dir(tmp_path):
    assert records_format(str(tmp_path / "new")) is None
    store(tmp_path / "plain", plain=True).close()
    store(tmp_path / "sealed", plain=False).close()
    assert records_format(str(tmp_path / "plain")) == "plain"
    assert records_format(str(tmp_path / "sealed")) == "sealed"
    assert oct(os.stat(tmp_path / "plain").st_mode & 0o777) == oct(0o700)
    with pytest.raises(PlaintextDir, match="plaintext records.*--data-dir"):
        store(tmp_path / "plain", plain=False)
    with pytest.raises(PlaintextDir, match="holds sealed"):
        store(tmp_path / "sealed", plain=True)
    store(tmp_path / "plain", plain=True).close()  # reopened as what it is
    (tmp_path / "plain" / "records").write_text("rot13\n")
    with pytest.raises(PlaintextDir, match="unknown record format 'rot13'"):
        store(tmp_path / "plain", plain=True)


def test_a_socket_that_cannot_be_bound_is_named(tmp_path):
    """A plain server has no TCP data plane: a Unix socket it cannot bind is the error,
    by its path (not a TypeError about a TCP address it never had)."""
    from cacheserver.server import CacheServer, ServerConfig

    sock = tmp_path / "missing" / "data.sock"
    with pytest.raises(OSError) as err:
        CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=str(tmp_path / "d"), capacity=1 << 26,
                                 unix_socket=str(sock), plain=True))
    assert not isinstance(err.value, TypeError) and str(sock) in str(err.value)
