"""Certificates and keys of a deployment: a CA, the SuperLink's TLS
certificate it signs, and SuperNode authentication key pairs; secrets are
written readable by their owner only."""

from __future__ import annotations

import datetime
import ipaddress
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import made_folder_problem, write_atomic

if TYPE_CHECKING:  # cryptography loads in the functions that use it, not with pollen
    from cryptography.hazmat.primitives.asymmetric.ec import (
        EllipticCurvePrivateKey,
        EllipticCurvePublicKey,
    )
    from cryptography.x509 import (
        Certificate,
        CertificateBuilder,
        GeneralName,
        KeyUsage,
        Name,
    )

CA_NAME = "pollen CA"  # the CA certificate's common name
Validity = tuple[datetime.datetime, datetime.datetime]  # not before, not after


def make_certificates(directory: Path, hosts: Sequence[str], days: int = 365) -> None:
    """A CA (`ca.pem`) and a SuperLink certificate it signs (`server.pem`,
    `server.key`) whose subject alternative names are `hosts` (names or IP
    addresses). The CA's private key is kept beside them (`ca.key`) so more
    certificates can be issued; keep it off the SuperLink in production."""
    from cryptography.hazmat.primitives.asymmetric import ec

    if not hosts:
        raise ValueError("certificates need at least one host name or address")
    check_hosts(hosts)
    now = datetime.datetime.now(datetime.UTC)
    validity = (
        now - datetime.timedelta(minutes=5),
        now + datetime.timedelta(days=days),
    )
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _ca_certificate(ca_key, validity)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _server_certificate(server_key, hosts, ca_key, validity)
    if problem := made_folder_problem(directory):
        raise CertificateError(f"cannot keep certificates in {directory}: {problem}")
    ca_pem, ca_private, server_pem, server_private = certificate_files(directory)
    write_atomic(ca_private, _private_pem(ca_key), private=True)
    write_atomic(server_private, _private_pem(server_key), private=True)
    ca_pem.write_bytes(_public_pem(ca))
    server_pem.write_bytes(_public_pem(server))


def _ca_certificate(key: EllipticCurvePrivateKey, validity: Validity) -> Certificate:
    """The CA's self-signed certificate: it may sign certificates, but not
    certificates of other CAs (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    return (
        _certificate(CA_NAME, CA_NAME, key.public_key(), validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_ca_key_usage(), critical=True)
        .sign(key, hashes.SHA256())
    )


def _server_certificate(
    key: EllipticCurvePrivateKey,
    hosts: Sequence[str],
    ca_key: EllipticCurvePrivateKey,
    validity: Validity,
) -> Certificate:
    """The SuperLink's certificate for `key`, named after its first host and
    valid for all of `hosts`, for TLS servers only, signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    return (
        _certificate(hosts[0], CA_NAME, key.public_key(), validity)
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


def _certificate(
    subject: str, issuer: str, key: EllipticCurvePublicKey, validity: Validity
) -> CertificateBuilder:
    """What both certificates have: `subject` and `issuer` (common names),
    the public `key`, a random serial number and the `validity` period (not
    before, not after); their extensions are added to it."""
    from cryptography import x509

    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
    )


def _name(common_name: str) -> Name:
    """A certificate's subject or issuer: a common name, nothing more."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _private_pem(key: EllipticCurvePrivateKey) -> bytes:
    """`key` as an unencrypted PKCS #8 PEM (the file is the protection)."""
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=serialization.NoEncryption(),
    )


def _public_pem(certificate: Certificate) -> bytes:
    """`certificate` as PEM, the form TLS configurations read."""
    from cryptography.hazmat.primitives import serialization

    return certificate.public_bytes(serialization.Encoding.PEM)


def certificate_files(directory: Path) -> tuple[Path, Path, Path, Path]:
    """The files `make_certificates` writes: CA certificate and key, SuperLink
    certificate and key."""
    return (
        directory / "ca.pem",
        directory / "ca.key",
        directory / "server.pem",
        directory / "server.key",
    )


def _ca_key_usage() -> KeyUsage:
    """A CA's key signs certificates (and revocation lists), nothing else."""
    from cryptography import x509

    uses = ("digital_signature", "key_cert_sign", "crl_sign")
    others = ("content_commitment", "key_encipherment", "data_encipherment",
              "key_agreement", "encipher_only", "decipher_only")  # fmt: skip
    return x509.KeyUsage(**dict.fromkeys(uses, True), **dict.fromkeys(others, False))


# a DNS name as a certificate holds it: ASCII labels of letters, digits and
# inner hyphens (a name in another script goes in its punycode form, xn--...)
_HOST_NAME = re.compile(
    r"(?=.{1,253}\.?$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?"
)


class CertificateError(ValueError):
    """A host a certificate cannot name; nothing was written."""


def check_hosts(hosts: Sequence[str]) -> None:
    """Refuse a host that is neither an IP address nor a DNS name."""
    for host in hosts:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _HOST_NAME.fullmatch(host):
                raise CertificateError(
                    f"host {host!r} is neither an IP address nor a DNS name "
                    "(ASCII letters, digits, inner hyphens and dots; a name in "
                    "another script in its xn-- form)"
                ) from None


def _san(host: str) -> GeneralName:
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
