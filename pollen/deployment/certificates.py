"""Certificates and keys of a deployment: a CA, the SuperLink's TLS
certificate it signs, and SuperNode authentication key pairs; secrets are
written readable by their owner only."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from ..files import write_atomic


def make_certificates(directory: Path, hosts: Sequence[str], days: int = 365) -> None:
    """A CA (`ca.pem`) and a SuperLink certificate it signs (`server.pem`,
    `server.key`) whose subject alternative names are `hosts` (names or IP
    addresses). The CA's private key is kept beside them (`ca.key`) so more
    certificates can be issued; keep it off the SuperLink in production."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not hosts:
        raise ValueError("certificates need at least one host name or address")
    now = datetime.datetime.now(datetime.UTC)
    valid_from, valid_to = (
        now - datetime.timedelta(minutes=5),
        now + datetime.timedelta(days=days),
    )
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pollen CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_to)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_ca_key_usage(), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_to)
        .add_extension(
            x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    private = dict(
        encoding=pem,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=serialization.NoEncryption(),
    )
    directory.mkdir(parents=True, exist_ok=True)
    ca_pem, ca_private, server_pem, server_private = certificate_files(directory)
    write_atomic(ca_private, ca_key.private_bytes(**private), private=True)
    write_atomic(server_private, server_key.private_bytes(**private), private=True)
    ca_pem.write_bytes(ca.public_bytes(pem))
    server_pem.write_bytes(server.public_bytes(pem))


def certificate_files(directory: Path) -> tuple[Path, Path, Path, Path]:
    """The files `make_certificates` writes: CA certificate and key, SuperLink
    certificate and key."""
    return (
        directory / "ca.pem",
        directory / "ca.key",
        directory / "server.pem",
        directory / "server.key",
    )


def _ca_key_usage():
    """A CA's key signs certificates (and revocation lists), nothing else."""
    from cryptography import x509

    uses = ("digital_signature", "key_cert_sign", "crl_sign")
    others = ("content_commitment", "key_encipherment", "data_encipherment",
              "key_agreement", "encipher_only", "decipher_only")  # fmt: skip
    return x509.KeyUsage(**dict.fromkeys(uses, True), **dict.fromkeys(others, False))


def _san(host: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_node_key(path: Path) -> Path:
    """A SuperNode's authentication key pair (OpenSSH ECDSA P-384, as
    `flower-supernode --auth-supernode-private-key` reads): `path` and
    `path.pub`, the one to register with `flwr supernode register`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    write_atomic(path, secret, private=True)
    public = path.with_name(path.name + ".pub")
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n"
    )
    return public
