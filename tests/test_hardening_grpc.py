"""Issue 12 item 2 on gRPC: senders that stall mid-message cannot make a server
hold more than --max-grpc-calls messages, the calls past it are refused at once
(RESOURCE_EXHAUSTED), and stalled connections are cut off; a real daemon, and
a raw HTTP/2 peer (h2) that sends part of a Put and stops."""
import hashlib
import select
import socket
import time
import urllib.parse

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from cacheserver.client.server_client import ServerClient
from procs import cacheserver, rss_bytes

MESSAGE = 60 << 20
SENT = 40 << 20


class StalledPut:
    """A gRPC Put whose message announces `message` bytes, of which `sent` are sent."""

    def __init__(self, address: str, message: int = MESSAGE, sent: int = SENT,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(self.sid, [(":method", "POST"), (":scheme", "http"),
                                          (":path", "/mlcache.v1.Cache/Put"), (":authority", address),
                                          ("content-type", "application/grpc"), ("te", "trailers"),
                                          *headers])
        self.events: list = []
        self.closed = self.ended = False
        payload = b"\0" + message.to_bytes(4, "big") + bytes(sent)
        at, deadline = 0, time.monotonic() + 30
        while at < len(payload) and not self.status() and time.monotonic() < deadline and not self.closed:
            n = min(self.conn.local_flow_control_window(self.sid), self.conn.max_outbound_frame_size,
                    len(payload) - at)
            if n > 0:
                self.conn.send_data(self.sid, payload[at:at + n])
                at += n
            self.pump(0.02)
        self.sent = at

    def pump(self, wait_s: float) -> None:
        self.sock.sendall(self.conn.data_to_send())
        if self.closed or not select.select([self.sock], [], [], wait_s)[0]:
            return
        data = self.sock.recv(1 << 16)
        if not data:
            self.closed = True
            return
        if self.ended:  # after the server's GOAWAY: read on until it closes the connection
            return
        try:
            self.events += self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:  # frames after the server's GOAWAY
            self.ended = True
            return
        self.ended = any(isinstance(e, h2.events.ConnectionTerminated) for e in self.events)
        self.sock.sendall(self.conn.data_to_send())

    def status(self) -> str | None:
        return self.trailer(b"grpc-status")

    def trailer(self, name: bytes) -> str | None:
        for e in self.events:
            if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
                headers = {bytes(k): bytes(v) for k, v in e.headers}
                if name in headers:
                    return urllib.parse.unquote(headers[name].decode())
        return None


def test_stalled_grpc_senders_are_capped_refused_and_cut_off(tmp_path):
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--unix-socket", "off", "--max-batch-size", "64MiB",
                    "--max-grpc-calls", "2", "--request-timeout", "1").start()
    puts: list[StalledPut] = []
    try:
        base = rss_bytes(s.pid)
        puts = [StalledPut(s.address) for _ in range(5)]
        time.sleep(0.5)
        grown = rss_bytes(s.pid) - base
        refused = [p for p in puts if p.status() == "8"]  # RESOURCE_EXHAUSTED
        assert len(refused) == 3 and all(p.sent < SENT for p in refused), [(p.sent, p.status()) for p in puts]
        assert grown < 2 * SENT + (40 << 20), grown >> 20  # two messages held, not five
        stalled = [p for p in puts if p not in refused]
        deadline = time.monotonic() + 30  # connection age 10 s plus 1 s of grace
        while not all(p.closed for p in stalled) and time.monotonic() < deadline:
            for p in stalled:
                p.pump(0.1)
        assert all(p.closed for p in stalled)
        value = b"z" * 1000
        with ServerClient(s.address, use_dataplane=False) as c:
            assert c.put([(hashlib.sha256(value).digest(), value)])[0] == 1
    finally:
        for p in puts:
            p.sock.close()
        assert s.stop() == 0
