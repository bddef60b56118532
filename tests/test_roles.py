"""Issue 12 item 7 (in part): the manager's role by a shared cluster token; real daemons."""
import base64
import hashlib
import os
import subprocess
import sys

import grpc
import pytest

from cacheserver.client.server_client import ServerClient
from cacheserver.vocab import CacheMode
from procs import ROOT, cacheserver, free_port

BYPASS = CacheMode.BYPASS.code


def _token_file(tmp_path) -> tuple[str, bytes]:
    token = base64.b64encode(os.urandom(32))
    path = tmp_path / "cluster.token"
    path.write_bytes(token + b"\n")
    path.chmod(0o600)
    return str(path), token


def test_control_operations_need_the_cluster_token(tmp_path):
    path, token = _token_file(tmp_path)
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--cluster-token-file", path).start()
    try:
        value = b"z" * 500
        key = hashlib.sha256(value).digest()
        with ServerClient(s.address) as plain, ServerClient(s.address, control_token=token) as manager:
            assert manager.set_job_mode("victim", BYPASS) == 0
            manager.active_chunk("ds", 2)
            refused = {
                "SetJobMode": lambda: plain.set_job_mode("victim", 0),
                "EvictDataset": lambda: plain.evict_dataset("ds"),
                "EvictChunk": lambda: plain.evict_chunk("ds", 0, force=True),
                "RefChunk": lambda: plain.ref_chunk("ds", 0, "me"),
                "UnrefChunk": lambda: plain.unref_chunk("ds", 0, "victim"),
                "ActiveChunk": lambda: plain.active_chunk("ds", 5),
            }
            for op, call in refused.items():
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert f"{op} is an operation of the cache manager" in e.value.details()
            # plain clients: look up, get, put, replace, and ask the active chunk
            assert plain.put([(key, value)])[0] == 1
            assert plain.put([(key, value)], replace=True)[0] == 1
            assert plain.lookup([key]) == b"\x01" and bytes(plain.get([key])[0]) == value
            assert plain.active_chunk("ds") == 2
            public, full = plain.stats(), manager.stats()
        assert dict(full.job_modes) == {"victim": BYPASS} and dict(full.active_chunks) == {"ds": 2}
        assert not public.job_modes and not public.active_chunks and not public.chunks
        assert public.items == full.items == 1
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("daemon", ["cacheserver.serverd", "manager.managerd"])
@pytest.mark.parametrize("content,why", [
    (b"short", "the token has 5 bytes, at least 16 are needed"),
    # raw bytes (not ASCII, or with inner spaces) cannot travel as gRPC metadata: refused on reading
    (bytes(range(200, 232)), "the token must be printable ASCII without spaces"),
    (b"a token with inner spaces", "byte 1 is 0x20")])
def test_bad_token_file_is_one_line_exit_2(tmp_path, daemon, content, why):
    weak = tmp_path / "weak.token"
    weak.write_bytes(content)
    weak.chmod(0o600)
    argv = [sys.executable, "-m", daemon, "--listen", f"127.0.0.1:{free_port()}",
            "--cluster-token-file", str(weak)]
    argv += (["--data-dir", str(tmp_path / "d"), "--capacity", "64MB"] if daemon.startswith("cache")
             else ["--state-dir", str(tmp_path / "m")])
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert why in last and str(weak) in last, last


def test_replaces_counted_per_client_identity(tmp_path):
    import urllib.request

    port = free_port()
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--metrics-port", str(port)).start()
    try:
        value = b"r" * 300
        item = [(hashlib.sha256(value).digest(), value)]
        transports = [{"use_dataplane": False}, {"prefer_unix": False, "local_read": False}, {}]
        for n, kw in enumerate(transports, 1):
            with ServerClient(s.address, **kw) as c:
                for _ in range(n):
                    c.put(item, replace=True)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'mlcache_server_replaces_total{peer="tcp:127.0.0.1"} 3.0' in text  # gRPC 1 + TCP 2
        assert f'mlcache_server_replaces_total{{peer="unix:uid={os.getuid()}"}} 3.0' in text
    finally:
        assert s.stop() == 0


def test_under_mutual_tls_the_manager_role_comes_from_the_certificate(tmp_path):
    from cacheserver.certs import write_bundle
    from cacheserver.tls import TlsFiles
    b = write_bundle(tmp_path / "certs")
    s = cacheserver(str(tmp_path / "d"), "64MB", 0, "--tls-cert", str(b.server_cert),
                    "--tls-key", str(b.server_key), "--tls-ca", str(b.ca)).start()
    as_manager = TlsFiles(str(b.manager_cert), str(b.manager_key), str(b.ca))
    as_client = TlsFiles(str(b.client_cert), str(b.client_key), str(b.ca))
    as_peer = TlsFiles(str(b.server_cert), str(b.server_key), str(b.ca))
    try:
        value = b"m" * 300
        key = hashlib.sha256(value).digest()
        with ServerClient(s.address, tls=as_manager) as manager:
            assert manager.set_job_mode("victim", BYPASS) == 0
            manager.active_chunk("ds", 1)
            full = manager.stats()
        assert dict(full.job_modes) == {"victim": BYPASS} and dict(full.active_chunks) == {"ds": 1}
        for who in (as_client, as_peer):
            with ServerClient(s.address, tls=who) as c:
                for call in (lambda: c.set_job_mode("victim", 0), lambda: c.evict_dataset("ds")):
                    with pytest.raises(grpc.RpcError) as e:
                        call()
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "needs a manager certificate (manager.pem" in e.value.details()
                assert c.put([(key, value)])[0] in (0, 1) and bytes(c.get([key])[0]) == value
                public = c.stats()
            assert not public.job_modes and not public.active_chunks and public.items == 1
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("mode,ok", [(0o600, True), (0o440, True), (0o640, True), (0o644, False), (0o660, False),
                                     (0o604, False)])
def test_a_token_file_may_be_read_by_a_group_as_kubernetes_mounts_secrets(tmp_path, mode, ok):
    """A Secret's files in a pod are root's, mode 0440, in the pod's fsGroup: the server (its
    own uid) reads the token through the group. Refused for 'readable by others' before, so
    a DaemonSet had no way to pass a cluster token. Others reading it, or a group writing
    it, stay refused."""
    from cacheserver.roles import read_token

    path = tmp_path / "token"
    path.write_bytes(b"k" * 32)
    path.chmod(mode)
    if ok:
        assert read_token(str(path)) == b"k" * 32
    else:
        with pytest.raises(ValueError, match="readable or writable by others"):
            read_token(str(path))
