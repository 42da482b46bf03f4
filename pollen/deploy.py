"""`pollen deploy`: a Flower deployment of real processes on this machine.

`up` starts one `flower-superlink` (state database, TLS, SuperNode
authentication) and N `flower-supernode`s, each with its own node config
(`partition-id`, `num-partitions`, `data-root`, `state-dir`), its own key
registered with the SuperLink, its own log and its own Flower home. Every
process runs in its own process group, recorded by PID in
`deployment.json`, so `down` stops exactly what `up` started. Runs are
submitted with `pollen run . --deployment DIR` (or `flwr run . pollen` with
`FLWR_HOME=DIR/flwr-home`).

The same files serve a deployment across machines: `pollen deploy certs`
makes the CA and the SuperLink's certificate (subject alternative names for
every host name or address the SuperNodes use), `pollen deploy key` makes a
SuperNode's key pair; the README shows the `flower-superlink`,
`flwr supernode register` and `flower-supernode` commands that use them.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

CONNECTION = "pollen"
STATE_FILE = "deployment.json"
START_SECONDS = 60.0
DEFAULT_HOSTS = ("localhost", "127.0.0.1")


class DeployError(RuntimeError):
    """A deployment cannot be brought up, inspected or stopped as asked."""


# --- certificates and keys ---------------------------------------------------


def write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as f:
        f.write(data)


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
        raise DeployError("certificates need at least one host name or address")
    now = datetime.datetime.now(datetime.timezone.utc)
    valid_from, valid_to = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
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
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
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
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
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
    write_private(directory / "ca.key", ca_key.private_bytes(**private))
    write_private(directory / "server.key", server_key.private_bytes(**private))
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    (directory / "server.pem").write_bytes(server.public_bytes(pem))


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
    write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
    )
    public = path.with_name(path.name + ".pub")
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n"
    )
    return public


# --- processes ---------------------------------------------------------------


def entry_point(name: str) -> str:
    """A command installed next to this Python (the project's venv) or on PATH."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def flower_env(home: Path) -> dict[str, str]:
    """The environment of a Flower process with its own home, using this
    Python's entry points and never installing dependencies at run time."""
    return {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }


def start(command: list[str], home: Path, log: Path) -> int:
    """Start `command` in its own process group, output to `log`; its PID."""
    home.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        process = subprocess.Popen(
            command,
            env=flower_env(home),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process.pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def stop(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the process group `pid` leads, then SIGKILL it after `grace` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    return
            except ChildProcessError:  # not our child: poll instead
                if not alive(pid):
                    return
            time.sleep(0.1)


# --- the deployment ----------------------------------------------------------


@dataclass
class Node:
    partition_id: int
    pid: int
    node_config: str
    log: str
    key: str = ""


@dataclass
class Deployment:
    """What `up` started, as recorded in `DIR/deployment.json`."""

    directory: str
    address: str
    insecure: bool
    superlink_pid: int = 0
    nodes: list[Node] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return Path(self.directory)

    @property
    def flwr_home(self) -> Path:
        """The Flower home whose config names this deployment `pollen`."""
        return self.root / "flwr-home"

    @property
    def ca(self) -> Path:
        return self.root / "certs" / "ca.pem"

    def save(self) -> None:
        path = self.root / STATE_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> Deployment:
        path = directory / STATE_FILE
        try:
            raw = json.loads(path.read_text())
            raw["nodes"] = [Node(**n) for n in raw["nodes"]]
            return cls(**raw)
        except FileNotFoundError:
            raise DeployError(f"no deployment in {directory} ({STATE_FILE} missing)") from None
        except (ValueError, TypeError, KeyError) as err:
            raise DeployError(f"{path} is not a pollen deployment record: {err}") from None

    def write_flower_config(self) -> None:
        """The connection `flwr run . pollen` uses with FLWR_HOME=flwr_home."""
        lines = ['[superlink]', f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]",
                 f'address = "{self.address}"']  # fmt: skip
        lines.append("insecure = true" if self.insecure else f'root-certificates = "{self.ca}"')
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        (self.flwr_home / "config.toml").write_text("\n".join(lines) + "\n")

    def flwr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the `flwr` CLI against this deployment."""
        result = subprocess.run(
            [entry_point("flwr"), *args], env=flower_env(self.flwr_home),
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise DeployError(
                f"flwr {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
        return result
