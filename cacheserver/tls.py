"""Mutual TLS material for gRPC and the data plane (certificates: `cachectl certs`):
the `--tls-*` flags every command declares, and the gRPC channels every client opens."""
from __future__ import annotations

import argparse
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

# Reconnect quickly once the manager is back (gRPC's default back-off grows to 2 minutes).
FAST_RECONNECT = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                  ("grpc.max_reconnect_backoff_ms", 2000))


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str
    ca: str

    @staticmethod
    def from_args(cert: str | None, key: str | None, ca: str | None) -> "TlsFiles | None":
        given = [x for x in (cert, key, ca) if x]
        if not given:
            return None
        if len(given) != 3:
            raise ValueError("TLS needs all of --tls-cert, --tls-key and --tls-ca")
        for name, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
            if not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path}")
        return TlsFiles(cert, key, ca)

    def read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.check_hostname = False  # servers are addressed by IP on the ring; the CA pins identity
        return ctx


def add_tls_flags(p: argparse.ArgumentParser, *, serves: bool, peers: str, cert_note: str = "") -> None:
    """Declare --tls-cert, --tls-key and --tls-ca. `serves`: the command listens
    (its certificate enables mutual TLS); else it dials `peers` that run with TLS."""
    if serves:
        p.add_argument("--tls-cert", default=None,
                       help=f"certificate (PEM); enables mutual TLS{cert_note}")
        p.add_argument("--tls-key", default=None, help="private key (PEM)")
        p.add_argument("--tls-ca", default=None, help=f"CA certificate that signs {peers} (PEM)")
    else:
        p.add_argument("--tls-cert", default=None, help=f"client certificate (PEM), for {peers} run with TLS")
        p.add_argument("--tls-key", default=None, help="client private key (PEM)")
        p.add_argument("--tls-ca", default=None, help=f"CA certificate that signed {peers} (PEM)")


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    """The TlsFiles the --tls-* flags name (None without them); ValueError names a bad one."""
    return TlsFiles.from_args(getattr(args, "tls_cert", None), getattr(args, "tls_key", None),
                              getattr(args, "tls_ca", None))


def grpc_channel(address: str, tls: TlsFiles | None, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A gRPC channel to `address`: mutual TLS with `tls`, plain without."""
    if tls:
        return grpc.secure_channel(address, tls.grpc_channel_credentials(), list(options))
    return grpc.insecure_channel(address, list(options))
