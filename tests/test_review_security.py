"""Attacks on the security model of docs/security.md, each by a second party on loopback:
the victim gets correct data or a clear error, never wrong data, and hands no plaintext
to anyone but its own processes."""
import hashlib
import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

torch = pytest.importorskip("torch")

from cacheserver import ops  # noqa: E402
from cacheserver.client.ring_client import RingClient  # noqa: E402
from cacheserver.client.server_client import RecordsMismatch, ServerClient  # noqa: E402
from cacheserver.proto import cache_pb2 as pb  # noqa: E402
from cacheserver.proto import cache_pb2_grpc as pb_grpc  # noqa: E402
from cacheserver.vocab import FETCH, PLAIN_RECORDS  # noqa: E402
from clients import capability  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.derived import derived_key, seal_derived  # noqa: E402
from preprocess.codec import encode  # noqa: E402
from test_verify_blake3 import make  # noqa: E402


class Impostor(pb_grpc.CacheServicer):
    """Another local user's gRPC server on the port a stopped embedded cache had: it says it
    holds plain records, serves `values` (id -> bytes) over gRPC or names a TCP data plane,
    and keeps what it is sent."""

    def __init__(self, values: dict[bytes, bytes], data_address: str = "") -> None:
        self.values, self.data_address, self.gets, self.puts = values, data_address, 0, []

    def Info(self, request, context):
        return pb.InfoResponse(server_id="impostor", instance="impostor", data_address=self.data_address,
                               max_batch_bytes=1 << 20, features=sorted(ops.FEATURES | {PLAIN_RECORDS}))

    def Get(self, request, context):
        self.gets += 1
        ids = [request.ids[i:i + 32] for i in range(0, len(request.ids), 32)]
        yield from ops.grpc_values([self.values.get(k) for k in ids], 1 << 20)

    def Put(self, request, context):
        self.puts.extend(bytes(it.value) for it in request.items)
        return pb.PutResponse(stored=len(request.items))

    def Lookup(self, request, context):
        return pb.LookupResponse(present=bytes(len(request.ids) // 32))

    def Claim(self, request, context):  # "read it yourself, and put it here"
        return pb.ClaimResponse(codes=bytes([FETCH]) * (len(request.ids) // 32))


def serve(impostor: Impostor, address: str) -> grpc.Server:
    srv = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_CacheServicer_to_server(impostor, srv)
    assert srv.add_insecure_port(address)
    srv.start()
    return srv


def stopped_embedded(tmp_path):
    """A DataLoader worker's copy of a dataset (pickled: no process state) whose embedded plain
    cache was filled and then stopped: what it reads goes to the cache's old address."""
    path, items = make(tmp_path / "ds", True, n=6)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    assert ds.plain_records
    assert ds.__getitems__(list(range(len(items)))) == items
    address = ds.embedded.address
    worker = CachedDataset.__new__(CachedDataset)
    worker.__setstate__(ds.__getstate__())  # as unpickled (its shared memory shared in-process)
    ds.close()
    return worker, items, address


@pytest.mark.parametrize("via", ["grpc", "tcp"])
def test_an_impostor_on_a_stopped_embedded_port_hands_a_worker_no_values(tmp_path, server, via):
    """Before: a client of a plain dir (a DataLoader worker) took values over gRPC or a TCP
    data plane from whoever answered on the embedded cache's old loopback port, and read
    them unhashed: training got the impostor's bytes. The docs promise values only over a
    Unix socket of this user's."""
    ds, items, address = stopped_embedded(tmp_path)
    ids = [capability.item_id(hashlib.sha256(x).digest()) for x in items]
    wrong = {k: b"E" * len(x) for k, x in zip(ids, items)}  # right sizes, other content
    data_address = ""
    if via == "tcp":  # a real cacheserver of the impostor's, holding the wrong bytes
        with ServerClient(server.address) as c:
            c.put(list(wrong.items()))
            data_address = c.info().data_address
    impostor = Impostor(wrong if via == "grpc" else {}, data_address)
    srv = serve(impostor, address)
    try:
        with pytest.raises(RecordsMismatch, match="no Unix socket of this user's"):
            got = ds.__getitems__(list(range(len(items))))
            assert got == items, "the impostor's bytes reached training"
        assert impostor.gets == 0
        with ServerClient(address, plain=True) as c:
            for _ in range(2):  # and not on a second try either
                with pytest.raises(RecordsMismatch, match="not over TCP or gRPC"):
                    c.get(ids[:1])
        with pytest.raises(RecordsMismatch):  # nor in the dataset's own ring
            ds.__getitems__([0])
        assert impostor.gets == 0
    finally:
        srv.stop(0)
        ds.close()


def test_an_impostor_on_a_stopped_embedded_port_is_sent_no_plaintext(tmp_path):
    """Before: the same client put each item it missed (read from the store, which the
    impostor cannot read) to the impostor as plaintext."""
    ds, items, address = stopped_embedded(tmp_path)
    impostor = Impostor({})  # answers every get with a miss
    srv = serve(impostor, address)
    try:
        try:
            ds.__getitems__([0, 1])
            refused = False
        except RecordsMismatch:
            refused = True
        assert impostor.puts == [], "plaintext items were put to the impostor"
        assert refused
        with RingClient([address], plain=True) as ring, pytest.raises(RecordsMismatch):
            ring.put([(capability.item_id(hashlib.sha256(items[0]).digest()), items[0])])
        assert impostor.puts == [] and impostor.gets == 0
    finally:
        srv.stop(0)
        ds.close()


def test_a_transformed_value_replayed_under_another_seed_source_or_transform_is_refused(server):
    """A co-holder of the source capability (or the server) copies genuine transformed
    values between slots: each slot's key binds K, the transform and the seed, so the
    victim finds each one poisoned, counts it and reads it as a miss."""
    from clients.transformed import TransformedItems

    K, K2 = hashlib.sha256(b"item").digest(), hashlib.sha256(b"other item").digest()
    with RingClient([server.address]) as ring:
        victim = TransformedItems(ring, "victim", "ds", "fp1", seed=1)
        for seed, fp, src in [(2, "fp1", K), (None, "fp1", K), (1, "fp2", K), (1, "fp1", K2)]:
            genuine = seal_derived(derived_key(src, fp, seed), encode(f"{fp} {seed} {src.hex()[:8]}"))
            ring.put([(victim.ids([K])[0], genuine.value)], "attacker", "ds", 0, replace=True)
            before = victim.counts.poisoned
            assert victim.get([K]) == [None] and victim.counts.poisoned == before + 1
        assert victim.put([K], ["right"], replace=True) == 1
        assert victim.get([K]) == ["right"]


def test_a_plain_client_still_reads_its_own_embedded_cache_over_its_socket(tmp_path):
    """The fix keeps the legitimate path: a worker of this user reaches the running embedded
    cache over its Unix socket (transport unix or local), values intact."""
    path, items = make(tmp_path / "ds", True, n=4)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    try:
        ds.__getitems__([0, 1, 2, 3])
        ids = [capability.item_id(hashlib.sha256(x).digest()) for x in items]
        code = ("import sys; from cacheserver.client.server_client import ServerClient\n"
                "with ServerClient(sys.argv[1], plain=True) as c:\n"
                "    got = c.get([bytes.fromhex(h) for h in sys.argv[2:]])\n"
                "    print(c.transport, ' '.join(bytes(v).hex() for v in got))\n")
        out = subprocess.run([sys.executable, "-c", code, ds.embedded.address, *(k.hex() for k in ids)],
                             check=True, timeout=60, capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split()
        assert out[0] in ("unix", "local") and [bytes.fromhex(h) for h in out[1:]] == items
    finally:
        ds.close()
