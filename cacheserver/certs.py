"""A private CA and server/client certificates for mutual TLS (`cachectl certs`).

One CA signs everything; servers trust clients signed by it and clients trust
servers signed by it (tls.py). Server certificates carry a SubjectAltName
with every DNS name and IP clients use to reach a server: gRPC checks it
against the address it dials. Keys are EC P-256 by default (RSA 2048 on
request), written as unencrypted PKCS#8 PEM with mode 0600.

Each leaf names its role in the subject's organizational unit (ROLES): a
cache server gives the manager role only to a `manager` certificate
(roles.py); `server` (peers) and `client` certificates are plain clients.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_SERVER_NAMES = ("localhost",)
DEFAULT_IPS = ("127.0.0.1",)
CA_DAYS = 3650
CERT_DAYS = 825  # leaf certificates; renew with `cachectl certs --force` and a restart
BACKDATE = dt.timedelta(minutes=5)  # tolerate small clock skew between hosts
KEY_TYPES = ("ec", "rsa")
ROLES = ("server", "manager", "client")  # the subject's OU (roles.py)

Key = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def new_key(key_type: str = "ec") -> Key:
    if key_type == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    raise ValueError(f"key type must be one of {', '.join(KEY_TYPES)}, got {key_type!r}")


def _name(common_name: str, role: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "mlcache")]
    if role is not None:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
    return x509.Name(attrs + [x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def cert_role(cert: x509.Certificate) -> str | None:
    """The role a leaf certificate names (its OU, one of ROLES), or None."""
    ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return next((str(a.value) for a in ous if a.value in ROLES), None)


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    if days < 1:
        raise ValueError(f"validity must be at least 1 day, got {days}")
    now = dt.datetime.now(dt.timezone.utc)
    return now - BACKDATE, now + dt.timedelta(days=days)


def make_ca(common_name: str = "mlcache CA", *, days: int = CA_DAYS,
            key_type: str = "ec") -> tuple[Key, x509.Certificate]:
    key = new_key(key_type)
    not_before, not_after = _validity(days)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def parse_ips(values: Sequence[str]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = []
    for v in values:
        try:
            out.append(ipaddress.ip_address(v.strip().strip("[]")))
        except ValueError:
            raise ValueError(f"not an IP address: {v!r}") from None
    return out


def make_cert(ca_key: Key, ca_cert: x509.Certificate, common_name: str, *, server: bool,
              dns_names: Sequence[str] = (), ips: Sequence[str] = (), days: int = CERT_DAYS,
              key_type: str = "ec", role: str | None = None) -> tuple[Key, x509.Certificate]:
    """A leaf certificate signed by the CA. Server certificates are valid for
    serverAuth and clientAuth (a node may also call its peers); client ones
    for clientAuth only. ``role``: see ROLES (default: server or client)."""
    role = role or ("server" if server else "client")
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    key = new_key(key_type)
    not_before, not_after = _validity(days)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server \
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    b = (x509.CertificateBuilder()
         .subject_name(_name(common_name, role)).issuer_name(ca_cert.subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(not_before).not_valid_after(min(not_after, ca_cert.not_valid_after_utc))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                      key_encipherment=isinstance(key, rsa.RSAPrivateKey),
                                      data_encipherment=False, key_agreement=False,
                                      key_cert_sign=False, crl_sign=False,
                                      encipher_only=False, decipher_only=False), critical=True)
         .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                        critical=False))
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys(dns_names) if n]
    sans += [x509.IPAddress(ip) for ip in dict.fromkeys(parse_ips(ips))]
    if server and not sans:
        raise ValueError("a server certificate needs at least one DNS name or IP")
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, b.sign(ca_key, hashes.SHA256())


def key_pem(key: Key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_file(path: Path, data: bytes, mode: int, *, force: bool = False) -> None:
    """Write with `mode` from the first byte on (a key is never briefly world-readable).
    Without force an existing file raises FileExistsError; with it the file is
    replaced atomically."""
    path = Path(path)
    if not force:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, mode)  # umask may have narrowed it
        return
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class Bundle:
    out_dir: Path
    files: tuple[Path, ...]

    @property
    def ca(self) -> Path:
        return self.out_dir / "ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.out_dir / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.out_dir / "server-key.pem"

    @property
    def manager_cert(self) -> Path:
        return self.out_dir / "manager.pem"

    @property
    def manager_key(self) -> Path:
        return self.out_dir / "manager-key.pem"

    @property
    def client_cert(self) -> Path:
        return self.out_dir / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.out_dir / "client-key.pem"


def bundle_names(clients: int = 1) -> list[str]:
    """Files `write_bundle` creates: client i >= 2 gets client-i.pem / client-i-key.pem."""
    names = ["ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "manager.pem", "manager-key.pem"]
    for i in range(1, clients + 1):
        stem = "client" if i == 1 else f"client-{i}"
        names += [f"{stem}.pem", f"{stem}-key.pem"]
    return names


def write_bundle(out_dir: str | os.PathLike, *, server_names: Sequence[str] = DEFAULT_SERVER_NAMES,
                 ips: Sequence[str] = DEFAULT_IPS, clients: int = 1, force: bool = False,
                 days: int = CERT_DAYS, ca_days: int = CA_DAYS, key_type: str = "ec") -> Bundle:
    """Create a CA, one server certificate and `clients` client certificates in
    out_dir. Refuses (FileExistsError, nothing written) if any target exists,
    unless force."""
    if clients < 0:
        raise ValueError(f"--clients must be >= 0, got {clients}")
    parse_ips(ips)  # validate before touching the disk
    out = Path(out_dir)
    names = bundle_names(clients)
    if not force:
        existing = [n for n in names if (out / n).exists()]
        if existing:
            raise FileExistsError(f"{out}: would overwrite {', '.join(existing)}")
    ca_key, ca_cert = make_ca(days=ca_days, key_type=key_type)
    pems: dict[str, tuple[bytes, int]] = {"ca.pem": (cert_pem(ca_cert), 0o644),
                                          "ca-key.pem": (key_pem(ca_key), 0o600)}
    cn = server_names[0] if server_names else "mlcache-server"
    key, cert = make_cert(ca_key, ca_cert, cn, server=True, dns_names=server_names, ips=ips,
                          days=days, key_type=key_type)
    pems["server.pem"], pems["server-key.pem"] = (cert_pem(cert), 0o644), (key_pem(key), 0o600)
    # The manager serves its own gRPC (same names) and calls servers with the manager role.
    key, cert = make_cert(ca_key, ca_cert, "mlcache-manager", server=True, dns_names=server_names, ips=ips,
                          days=days, key_type=key_type, role="manager")
    pems["manager.pem"], pems["manager-key.pem"] = (cert_pem(cert), 0o644), (key_pem(key), 0o600)
    for i in range(1, clients + 1):
        stem = "client" if i == 1 else f"client-{i}"
        key, cert = make_cert(ca_key, ca_cert, f"mlcache-{stem}", server=False, days=days,
                              key_type=key_type)
        pems[f"{stem}.pem"], pems[f"{stem}-key.pem"] = (cert_pem(cert), 0o644), (key_pem(key), 0o600)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    try:
        for name in names:
            data, mode = pems[name]
            write_file(out / name, data, mode, force=force)
            written.append(out / name)
    except FileExistsError:  # created concurrently: leave no half bundle behind
        for p in written:
            p.unlink(missing_ok=True)
        raise
    return Bundle(out, tuple(written))
