"""A get that finds a damaged record drops that record, never a value put again under its id meanwhile."""
import os

from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import Store


def test_a_corrupt_read_never_drops_the_value_put_again_meanwhile(tmp_path):
    """Two readers find the same damaged record: the first drops it, its client puts the item
    again; the second, dropping what it read, must not delete that acknowledged put."""
    s = Store(str(tmp_path / "s"), 10**7, LRUPolicy(), Counters())
    k, good = os.urandom(32), os.urandom(1000)
    s.put_many([(k, good)])
    s._db.put(k, b"bad!" * 250 + b"\0" * 8)  # damage the stored record under the store
    add, done = s._hits.add, []

    def other_reader_and_refill(keys):  # runs between the second reader's read and its drop
        if not done:
            done.append(True)
            assert s.get_many([k])[0] is None  # the first reader drops the damaged record
            assert s.put_many([(k, good)]) == (1, 0, 0)  # and the item is put again, acknowledged
        add(keys)

    s._hits.add = other_reader_and_refill
    try:
        assert s.get_many([k])[0] is None
    finally:
        s._hits.add = add
    assert done and s.contains([k]) == b"\x01"
    assert bytes(s.get_many([k])[0]) == good
    assert s.counters["corrupt_dropped"] == 1 and s.used == 1000 + s.overhead
    s.close()

