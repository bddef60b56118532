"""A read ahead of a same-host get (read from the follower while the server answers) that
another thread's catch-up overtakes: the answer's generation equals the follower's view by
the time it comes, but the values read ahead come from before that catch-up.

Follower.read trusted `ahead` whenever the answer's generation equalled the view then; a
second thread of the same client (tf_dataset's read_parallel, a loader's threads) that synced
to the new generation while the first one's request was in flight made the first one serve the
value a replace put had overwritten. The interleaving is forced with a hook at the read ahead,
against a real server process."""
import threading

from cacheserver.client import localread
from cacheserver.client.server_client import ServerClient
from procs import cacheserver, wait_until
from test_samehost_replace_view import NEW, OLD, K, _follower_has, _replaced_then_flushed


def test_a_read_ahead_that_another_thread_s_catch_up_overtook_is_read_again(tmp_path, monkeypatch):
    monkeypatch.setattr(localread, "MAX_STALE_S", 3600.0)  # only the answer's generation may start a catch-up
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--durability", "process").start()
    try:
        with ServerClient(s.address) as a, ServerClient(s.address, local_read=False) as w, \
                ServerClient(s.address, local_read=False) as probe:
            w.put([(K, OLD)])
            wait_until(lambda: _follower_has(a, OLD), "the follower reads the first value from its files")
            assert a.transport == "local" and a._local.view is not None
            _replaced_then_flushed(w, probe)
            other: list = []
            real = ServerClient._timed_read

            def ahead_then_other_thread(local, ids):
                got = real(local, ids)  # the follower's view from before the replace: the old value
                monkeypatch.setattr(ServerClient, "_timed_read", staticmethod(real))
                t = threading.Thread(target=lambda: other.append(bytes(a.get([K])[0])))
                t.start()  # its answer reports the new generation: it catches up, the view moves on
                t.join(30)
                return got

            monkeypatch.setattr(ServerClient, "_timed_read", staticmethod(ahead_then_other_thread))
            a._read_ahead = True
            got = bytes(a.get([K])[0])
            assert other == [NEW]
            assert got == NEW, "a value read ahead before another thread's catch-up was served"
    finally:
        assert s.stop() == 0
