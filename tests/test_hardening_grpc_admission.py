"""Issue 12 item 2 on gRPC: request bytes in flight. gRPC calls that carry ids
or values are admitted by their declared size against --max-inflight-bytes
(shared with the data plane) before their message is read; past it a call gets
RESOURCE_EXHAUSTED "server busy"; a caller that sends more than it declared is
refused. Real daemons; raw HTTP/2 senders (test_hardening_grpc.StalledPut)
that send part of a Put and stall."""
import hashlib
import logging
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cacheserver.client.ring_client import RingClient
from cacheserver.client.server_client import ServerClient
from cacheserver.proto import cache_pb2 as pb
from cacheserver.vocab import BODY_BYTES_HEADER
from procs import cacheserver, rss_bytes
from test_hardening_grpc import StalledPut

MiB = 1 << 20
MESSAGE, SENT, BUDGET = 40 * MiB, 36 * MiB, 48 * MiB


def _server(tmp_path):
    # --max-grpc-calls well above the senders: only the byte budget can hold them back.
    return cacheserver(str(tmp_path / "d"), "256MB", 0, "--unix-socket", "off", "--max-batch-size", "64MiB",
                       "--max-inflight-bytes", str(BUDGET), "--max-grpc-calls", "32",
                       "--request-timeout", "2").start()


def _declared(n: int) -> tuple[tuple[str, str], ...]:
    return ((BODY_BYTES_HEADER, str(n)),)


def test_stalled_grpc_senders_cannot_pass_the_byte_budget(tmp_path):
    s = _server(tmp_path)
    puts: list[StalledPut] = []
    try:
        base = rss_bytes(s.pid)
        # Three declare their size, three do not (counted as the largest message): six
        # bodies of 36 MiB would be 216 MiB held; the budget is 48 MiB.
        puts = [StalledPut(s.address, MESSAGE, SENT, _declared(MESSAGE) if i % 2 == 0 else ())
                for i in range(6)]
        time.sleep(0.5)
        grown = rss_bytes(s.pid) - base
        refused = [p for p in puts if p.status() == "8"]  # RESOURCE_EXHAUSTED
        assert len(refused) == 5, [(p.sent, p.status()) for p in puts]
        assert all(p.sent < SENT for p in refused)  # refused before their messages were read
        message = refused[0].trailer(b"grpc-message") or ""
        assert "server busy" in message and "--max-inflight-bytes" in message, message
        assert grown < BUDGET + 24 * MiB, grown // MiB
    finally:
        for p in puts:
            p.sock.close()
        assert s.stop() == 0


def test_a_client_put_past_the_budget_is_busy_then_admitted_once_it_frees(tmp_path, caplog):
    s = _server(tmp_path)
    stalled = StalledPut(s.address, MESSAGE, SENT, _declared(MESSAGE))  # holds 40 of the 48 MiB
    value = bytes(range(256)) * (16 * MiB // 256)
    item = (hashlib.sha256(value).digest(), value)
    try:
        with ServerClient(s.address, use_dataplane=False) as c:
            with pytest.raises(grpc.RpcError) as busy:
                c.put([item])
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "server busy" in busy.value.details() and "retry later" in busy.value.details()
            # A ring takes it as it takes the data plane's busy: that server's share is a miss
            # for its back-off, nothing is raised, the reason is logged.
            ring = RingClient([s.address], use_dataplane=False, down_backoff=0.2)
            try:
                with caplog.at_level(logging.WARNING, logger="cacheserver.ring"):
                    assert ring.put([item]) == 0 and ring.errors == 1
                assert "server busy" in caplog.text
            finally:
                ring.close()
            stalled.sock.close()  # its call is cancelled: its reservation goes back
            deadline, stored = time.monotonic() + 10, None
            while stored is None and time.monotonic() < deadline:
                try:
                    stored = c.put([item])
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    time.sleep(0.1)
            assert stored == (1, 0, 0)
            assert bytes(c.get([item[0]])[0]) == value
            assert c.stats().counters["busy_refused"] >= 1
    finally:
        stalled.sock.close()
        assert s.stop() == 0


def test_a_message_larger_than_declared_is_refused_and_counted(tmp_path):
    s = _server(tmp_path)
    try:
        with ServerClient(s.address, use_dataplane=False) as c:
            value = b"v" * 100_000
            req = pb.PutRequest(items=[pb.PutItem(id=hashlib.sha256(value).digest(), size=len(value), value=value)])
            with pytest.raises(grpc.RpcError) as lie:
                c.stub.Put(req, timeout=10, metadata=_declared(1000))
            assert lie.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "more than the 1000 declared" in lie.value.details(), lie.value.details()
            assert c.lookup([req.items[0].id]) == b"\0"  # nothing stored
            assert c.stats().counters["grpc_overdeclared"] == 1
    finally:
        assert s.stop() == 0


def test_health_watchers_take_no_call_slots(tmp_path):
    # grpc's client-side health checking keeps a Watch open per channel. Non-blocking in the
    # health service, a Watch holds no server thread and no --max-grpc-calls slot while it
    # waits: more watchers than slots must leave Cache calls (the manager's too) served.
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--unix-socket", "off", "--max-grpc-calls", "4").start()
    channel = grpc.insecure_channel(s.address)
    watches = []
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(8):
            w = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert next(w).status == health_pb2.HealthCheckResponse.SERVING
            watches.append(w)
        with ServerClient(s.address, use_dataplane=False) as c:
            assert c.lookup([b"k" * 32]) == b"\0" and c.stats().counters["busy_refused"] == 0
    finally:
        for w in watches:
            w.cancel()
        channel.close()
        assert s.stop() == 0
