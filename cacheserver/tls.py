"""Mutual TLS material for gRPC and the data plane (certificates: `cachectl certs`)."""
from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


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
