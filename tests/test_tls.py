"""Mutual TLS end to end: `cachectl certs`, a real cacheserver with --tls-*,
and clients with, without and with foreign certificates, on gRPC and the TCP data plane."""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
import ssl
import stat
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from cacheserver import certs, ops, wire
from cacheserver.client.server_client import ServerClient
from cacheserver.proto import cache_pb2 as pb
from cacheserver.proto import cache_pb2_grpc as pb_grpc
from cacheserver.tls import TlsFiles
from procs import free_port, ROOT, cacheserver

BUNDLE = ["ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "manager.pem", "manager-key.pem",
          "client.pem", "client-key.pem"]


def cachectl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "manager.ctl", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def ident(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls") / "certs"
    r = cachectl("certs", "--out", str(d))
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def tls_server(tls_dir, tmp_path_factory):
    dport = free_port()
    srv = cacheserver(str(tmp_path_factory.mktemp("tls-srv")), "1GB", 0, "--data-listen", f"127.0.0.1:{dport}",
                      "--tls-cert", str(tls_dir / "server.pem"), "--tls-key", str(tls_dir / "server-key.pem"),
                      "--tls-ca", str(tls_dir / "ca.pem")).start()
    srv.data_port = dport
    try:
        yield srv
        assert srv.stop() == 0  # drains and exits 0 after serving TLS clients
    finally:
        srv.kill()


def client_tls(d) -> TlsFiles:
    return TlsFiles(str(d / "client.pem"), str(d / "client-key.pem"), str(d / "ca.pem"))


def data_port(srv) -> int:
    return srv.data_port  # pinned by the fixture: a raw TLS peer cannot ask Info first


# ---- certificates -----------------------------------------------------------------
def test_certs_files_and_modes(tls_dir):
    assert sorted(os.listdir(tls_dir)) == sorted(BUNDLE)
    for name in BUNDLE:
        mode = stat.S_IMODE(os.stat(tls_dir / name).st_mode)
        if name.endswith("-key.pem"):
            assert mode == 0o600, f"{name}: {oct(mode)}"
        else:
            assert mode & 0o077 in (0o044, 0o004, 0o040, 0), f"{name}: {oct(mode)}"


def test_certs_contents(tls_dir):
    ca = x509.load_pem_x509_certificate((tls_dir / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((tls_dir / "server.pem").read_bytes())
    client = x509.load_pem_x509_certificate((tls_dir / "client.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert ExtendedKeyUsageOID.SERVER_AUTH in server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == \
        [ExtendedKeyUsageOID.CLIENT_AUTH]
    now = dt.datetime.now(dt.timezone.utc)
    for cert in (server, client):
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        assert cert.not_valid_before_utc <= now < cert.not_valid_after_utc
        assert dt.timedelta(days=300) < cert.not_valid_after_utc - now <= dt.timedelta(days=826)
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_certs_refuses_to_overwrite_and_force(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "server.pem").write_text("keep me")
    r = cachectl("certs", "--out", str(out))
    assert r.returncode == 1
    assert r.stderr.startswith("cachectl: ") and "server.pem" in r.stderr and "--force" in r.stderr
    assert "Traceback" not in r.stderr
    assert os.listdir(out) == ["server.pem"]  # nothing half-written
    assert (out / "server.pem").read_text() == "keep me"

    r = cachectl("certs", "--out", str(out), "--force", "--clients", "2", "--key-type", "rsa",
                 "--server-names", "cache-a", "cache-b.example", "--ips", "10.1.2.3,127.0.0.1", "::1")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == sorted(BUNDLE + ["client-2.pem", "client-2-key.pem"])
    server = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["cache-a", "cache-b.example"]
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["10.1.2.3", "127.0.0.1", "::1"]
    assert stat.S_IMODE(os.stat(out / "client-2-key.pem").st_mode) == 0o600
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # no temp files left


def test_certs_rejects_bad_ip(tmp_path):
    r = cachectl("certs", "--out", str(tmp_path / "x"), "--ips", "300.1.1.1")
    assert r.returncode == 2 and "not an IP address" in r.stderr
    assert not (tmp_path / "x").exists()


# ---- a TLS server -----------------------------------------------------------------
def test_client_with_cert_puts_and_gets_over_tcp_dataplane(tls_server, tls_dir):
    items = [(ident(i), os.urandom(1000 + i)) for i in range(20)]
    with ServerClient(tls_server.address, tls=client_tls(tls_dir), local_read=False,
                      prefer_unix=False, timeout=10) as c:
        assert c.info().tls
        assert c.put(items) == (20, 0, 0)
        assert c.transport == "tcp"
        assert [bytes(v) for v in c.get([k for k, _ in items])] == [v for _, v in items]
        assert c.lookup([ident(0), ident(999)]) == b"\x01\x00"


def test_client_with_cert_puts_and_gets_over_grpc(tls_server, tls_dir):
    items = [(ident(100 + i), os.urandom(500)) for i in range(5)]
    with ServerClient(tls_server.address, tls=client_tls(tls_dir), use_dataplane=False,
                      local_read=False, prefer_unix=False, timeout=10) as c:
        assert c.put(items) == (5, 0, 0)
        assert [bytes(v) for v in c.get([k for k, _ in items])] == [v for _, v in items]
        assert c.transport == "grpc"
        assert c.stats().counters["grpc_requests"] >= 2


def _grpc_info(channel: grpc.Channel) -> grpc.RpcError:
    with channel:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.CacheStub(channel).Info(pb.InfoRequest(), timeout=5)
    return e.value


def test_plaintext_grpc_is_refused(tls_server):
    err = _grpc_info(grpc.insecure_channel(tls_server.address))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_without_client_cert_is_refused(tls_server, tls_dir):
    creds = grpc.ssl_channel_credentials(root_certificates=(tls_dir / "ca.pem").read_bytes())
    err = _grpc_info(grpc.secure_channel(tls_server.address, creds))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_client_cert_from_another_ca_is_refused(tls_server, tls_dir, tmp_path):
    other = certs.write_bundle(tmp_path / "other")
    # Trusts the real server, but presents a client certificate the server's CA did not sign.
    tls = TlsFiles(str(other.client_cert), str(other.client_key), str(tls_dir / "ca.pem"))
    with ServerClient(tls_server.address, tls=tls, local_read=False, prefer_unix=False, timeout=5) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.info()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # And the data plane refuses the same certificate.
    ctx = tls.client_context()
    with socket.create_connection(("127.0.0.1", data_port(tls_server)), timeout=5) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with ctx.wrap_socket(raw) as s:
                wire.send_buffers(s, [wire.pack_header(ops.PING.code, 0, 0, 0)])
                if not s.recv(wire.HEADER.size):
                    raise ConnectionResetError("closed")


def test_plaintext_dataplane_is_refused(tls_server):
    with socket.create_connection(("127.0.0.1", data_port(tls_server)), timeout=5) as s:
        s.sendall(wire.pack_header(ops.PING.code, 0, 0, 0))
        try:
            reply = s.recv(64)
        except ConnectionError:
            reply = b""
    assert not reply.startswith(wire.MAGIC), f"plaintext ping answered: {reply!r}"


def test_dataplane_without_client_cert_is_refused(tls_server, tls_dir):
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls_dir / "ca.pem"))
    ctx.check_hostname = False
    with socket.create_connection(("127.0.0.1", data_port(tls_server)), timeout=5) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with ctx.wrap_socket(raw) as s:  # TLS 1.3: the refusal arrives on the first read
                wire.send_buffers(s, [wire.pack_header(ops.PING.code, 0, 0, 0)])
                if not s.recv(wire.HEADER.size):
                    raise ConnectionResetError("closed")


def test_server_still_serves_after_refusals(tls_server, tls_dir):
    with ServerClient(tls_server.address, tls=client_tls(tls_dir), local_read=False,
                      prefer_unix=False, timeout=10) as c:
        assert c.put([(ident(7777), b"after")]) == (1, 0, 0)
        assert bytes(c.get([ident(7777)])[0]) == b"after"


def test_cachectl_stats_over_tls(tls_server, tls_dir):
    r = cachectl("stats", tls_server.address, "--json", "--tls-cert", str(tls_dir / "client.pem"),
                 "--tls-key", str(tls_dir / "client-key.pem"), "--tls-ca", str(tls_dir / "ca.pem"), timeout=30)
    assert r.returncode == 0, r.stderr
    assert '"capacity_bytes": 1000000000' in r.stdout
    r = cachectl("stats", tls_server.address, "--timeout", "3", timeout=30)
    assert r.returncode == 1
    assert r.stderr.startswith(f"cachectl: cannot reach {tls_server.address}: ")
    assert "does it require TLS?" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = cachectl("stats", tls_server.address, "--tls-cert", str(tls_dir / "client.pem"), timeout=30)
    assert r.returncode == 2 and "all of --tls-cert, --tls-key and --tls-ca" in r.stderr


def test_idle_connection_does_not_block_the_tls_dataplane(tls_server, tls_dir):
    with socket.create_connection(("127.0.0.1", data_port(tls_server)), timeout=5):
        with ServerClient(tls_server.address, tls=client_tls(tls_dir), local_read=False,
                          prefer_unix=False, timeout=3) as c:
            assert c.put([(ident(4242), b"v")]) == (1, 0, 0)
