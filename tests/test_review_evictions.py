"""The manager's evictions on the cache servers (manager/actuator.py, manager/evictledger.py),
each defect reproduced with a real cachemanager and real cache servers.

1. An EvictChunk still queued for a server (its calls lag: a slow link, a call stuck up to
   --server-timeout) when the same chunk starts loading again landed after the clients' puts
   of the reload and deleted them.
2. An EvictDataset a server missed was remembered in memory only: a manager restart forgot it,
   and the re-planned dataset's old entries stayed pinned on that server."""
from __future__ import annotations

import json
import socket
import threading

import grpc
import pytest

from cacheserver.client.server_client import ServerClient
from cacheserver.proto import manager_pb2 as mpb
from cacheserver.proto import manager_pb2_grpc as mpb_grpc
from manager.manager_client import ManagerClient
from manager.model import ManagerModel, Rejected
from manager.policy import chunk_members
from procs import cachemanager, cacheserver, wait_ring, wait_until

DS = "e5" * 32
A, B = "a1" * 16, "b2" * 16


class PausableProxy:
    """A loopback TCP proxy whose caller-to-server direction can be held: the manager's calls
    to a server then wait (as on a slow link) while clients reach the server directly."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.open = threading.Event()
        self.open.set()
        self.held = 0  # bytes read from callers while paused, not yet forwarded
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self._lsock.settimeout(0.2)
        self.address = f"127.0.0.1:{self._lsock.getsockname()[1]}"
        self._spawn(self._accept)

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                a, _ = self._lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            b = socket.create_connection(self.target)
            self._socks += [a, b]
            self._spawn(self._pump, a, b, True)
            self._spawn(self._pump, b, a, False)

    def _pump(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if gated and not self.open.is_set():
                    self.held += len(data)
                    while not self.open.wait(0.1):
                        if self._stop.is_set():
                            return
                    self.held -= len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.open.set()
        self._lsock.close()
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self._threads:
            t.join(5)


def _register_server(manager: str, address: str) -> None:
    """Register a cache server with the manager under ``address`` (the proxy in front of it)."""
    with grpc.insecure_channel(manager) as ch:
        mpb_grpc.ManagerStub(ch).RegisterServer(
            mpb.RegisterServerRequest(server_id="srv-behind-proxy", address=address, capacity=64 << 20),
            timeout=5)


def _held(sc: ServerClient) -> dict[int, int]:
    return {c.chunk: c.items for c in sc.stats().chunks if c.dataset == DS}


def test_an_eviction_a_whole_pass_behind_spares_the_chunk_that_loads_again(tmp_path):
    """k == 3, two jobs: chunk 0 is evicted (both jobs released it), chunk 2 loads, becomes
    active, chunk 1 goes, and chunk 0 starts loading again, while the manager's calls to the
    server wait behind a stuck one (a slow link). The jobs' puts of the reloaded chunk 0 reach the server
    first. Before the fix EvictChunk(0) landed after them and deleted them: the chunk made
    active next held nothing (every read of it a miss again)."""
    m = cachemanager(str(tmp_path / "m"), 0, "--chunks", "--budget", "700kB", "--chunk-size", "300kB",
                     "--heartbeat-misses", "1000", "--reconcile-seconds", "60", "--server-timeout", "20").start()
    s = proxy = None
    try:
        s = cacheserver(str(tmp_path / "s"), "64MB", 0, "--data-listen", "127.0.0.1:0").start()
        proxy = PausableProxy(s.address)
        _register_server(m.address, proxy.address)
        wait_ring(m.address, 1)
        keys = [bytes([i + 1]) * 32 for i in range(3)]
        with ManagerClient(m.address) as mc, ServerClient(s.address) as sc:
            def put(c: int) -> None:
                sc.put([(keys[i], b"v" * 100) for r in chunk_members(c, 3, 3) for i in r], dataset=DS, chunk=c)

            def turn(old: int, new: int) -> None:
                """Chunk ``new`` loaded, both jobs done with ``old``."""
                put(new)
                assert mc.report_loaded(DS, new, 1.0).active == new
                for job in ("job-a", "job-b"):
                    mc.release_chunk(job, DS, old)

            mc.register_job("job-a", DS, 900_000, 3)
            plan = mc.register_job("job-b", DS, 900_000, 3).plan  # two jobs: chunked pays
            assert plan.option == "chunked" and plan.k == 3 and plan.loading == 0
            put(0)
            assert mc.report_loaded(DS, 0, 1.0).loading == 1
            wait_until(lambda: sc.active_chunk(DS) == 0, "ActiveChunk(0) on the server")
            proxy.open.clear()  # the manager's next call, ActiveChunk(1), waits in the proxy
            turn(0, 1)  # EvictChunk(0), queued behind it
            wait_until(lambda: proxy.held > 0, "the manager's ActiveChunk(1) held in the proxy")
            turn(1, 2)  # EvictChunk(1); chunk 0 loads again
            assert mc.get_plan(DS, "job-a").loading == 0
            put(0)  # the jobs load chunk 0, as their plan says
            assert _held(sc).get(0) == 1
            proxy.open.set()
            wait_until(lambda: 1 not in _held(sc), "EvictChunk(1): the calls before it landed", 30)
            assert _held(sc).get(0) == 1, "the eviction deleted the puts of the reloaded chunk 0"
            assert mc.report_loaded(DS, 0, 1.0).active == 0
            wait_until(lambda: sc.active_chunk(DS) == 0, "ActiveChunk(0) on the server")
            assert all(v is not None for v in sc.get([keys[i] for r in chunk_members(0, 3, 3) for i in r]))
    finally:
        if proxy is not None:
            proxy.close()
        if s is not None:
            s.kill()
        m.kill()


def test_the_journaled_missed_evictions_replay_exactly_and_bad_ones_are_refused():
    m = ManagerModel()
    m.apply({"type": "evictions_owed", "now": 1.0, "owed": {"h:2": [B, A, A], "h:1": [A], "h:3": []}})
    assert m.owed == {"h:1": [A], "h:2": [A, B]}
    again = ManagerModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again.owed == m.owed and again.digest() == m.digest()
    assert "owed" not in ManagerModel().to_dict()  # a state without any reads (and digests) as before
    for bad in ({"h:1": A}, {"h:1": [1]}, {"": [A]}, [A]):
        with pytest.raises(Rejected, match="owed"):
            m.apply({"type": "evictions_owed", "now": 2.0, "owed": bad})
    assert m.owed == {"h:1": [A], "h:2": [A, B]}
