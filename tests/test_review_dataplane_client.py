"""The client side of the data plane against a peer whose answers are broken: a length
no server could send, sizes that do not fill the body, answers for another number of
ids. Each is a failed server (its share a miss), never an allocation of that length, a
struct error in training, or values cut short."""
import random
import socket
import struct
import threading
import time
from concurrent import futures

import grpc
import pytest

from cacheserver import ops, wire
from cacheserver.client.ring_client import RingClient
from cacheserver.client.server_client import ServerClient
from cacheserver.proto import cache_pb2 as pb
from cacheserver.proto import cache_pb2_grpc as pb_grpc


class BrokenPeer:
    """A gRPC Info naming a data-plane listener that reads each request and sends
    answer(op, count) back: a real socket peer whose frames are made to order."""

    def __init__(self, answer):
        self.answer = answer
        self.lsock = socket.create_server(("127.0.0.1", 0))
        data_port = self.lsock.getsockname()[1]

        class Info(pb_grpc.CacheServicer):
            def Info(self, request, context):
                return pb.InfoResponse(instance="broken", data_address=f"127.0.0.1:{data_port}",
                                       max_batch_bytes=1 << 20, features=sorted(ops.FEATURES))

        self.grpc = grpc.server(futures.ThreadPoolExecutor(2))
        self.address = f"127.0.0.1:{self.grpc.add_insecure_port('127.0.0.1:0')}"
        pb_grpc.add_CacheServicer_to_server(Info(), self.grpc)
        self.grpc.start()
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            conn.settimeout(10)
            while True:
                try:
                    op, _aux, count, body_len = wire.unpack_header(wire.recv_exact(conn, wire.HEADER.size))
                    wire.recv_exact(conn, body_len)
                    self.requests += 1
                    conn.sendall(self.answer(op, count))
                except OSError:
                    return

    def close(self):
        self.lsock.close()
        self.grpc.stop(0)


def _ids(n):
    rng = random.Random(3)
    return [rng.randbytes(32) for _ in range(n)]


BROKEN_GETS = {
    "a huge length": lambda op, n: wire.pack_header(wire.OK, 0, n, 1 << 45),
    "a length past the server's batch limit": lambda op, n: wire.pack_header(wire.OK, 0, n, 1 << 36),
    "sizes cut short": lambda op, n: wire.pack_header(wire.OK, 0, n, 4) + b"\0" * 4,
    "sizes past the body": lambda op, n: wire.pack_header(wire.OK, 0, n, 4 * n + 3)
    + struct.pack(f"<{n}I", *[3] * n) + b"abc",
    "values for fewer ids": lambda op, n: wire.pack_header(wire.OK, 0, 1, 7) + struct.pack("<I", 3) + b"abc",
    "values for more ids": lambda op, n: wire.pack_header(wire.OK, 0, n + 1, 4 * (n + 1))
    + struct.pack(f"<{n + 1}I", *[0] * (n + 1)),
}


@pytest.mark.parametrize("case", list(BROKEN_GETS))
def test_a_broken_get_answer_is_a_failed_server_not_an_error_or_wrong_values(case):
    peer = BrokenPeer(BROKEN_GETS[case])
    try:
        ks = _ids(3)
        with ServerClient(peer.address, timeout=5) as c:
            t = time.monotonic()
            with pytest.raises(wire.ProtocolError, match=r"answer|get of 3 ids"):
                c.get(ks)
            assert time.monotonic() - t < 5  # refused as it came, not waited on
        with RingClient([peer.address], timeout=5, down_backoff=60) as ring:
            assert ring.get(ks) == [None, None, None]  # its share a miss; training sees nothing
            assert ring.errors == 1
    finally:
        peer.close()


def test_a_broken_put_answer_is_a_failed_server():
    peer = BrokenPeer(lambda op, n: wire.pack_header(wire.OK, 0, 3, 4) + b"\1\0\0\0")
    try:
        items = [(k, b"value") for k in _ids(2)]
        with ServerClient(peer.address, timeout=5) as c:
            with pytest.raises(wire.ProtocolError, match="put's answer has 4 bytes, not 12"):
                c.put(items)
        with RingClient([peer.address], timeout=5, down_backoff=60) as ring:
            assert ring.put(items) == 0
            assert ring.errors == 1
    finally:
        peer.close()
