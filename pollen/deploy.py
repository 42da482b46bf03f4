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

import contextlib
import datetime
import ipaddress
import json
import os
import signal
import socket
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
EXECUTORS = ("warm", "cold")
TASK_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
TASK_POLL_SECONDS = "0.1"  # Flower's default, 1 s, is added to every message
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
    write_private(ca_private, ca_key.private_bytes(**private))
    write_private(server_private, server_key.private_bytes(**private))
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


def register_key(public: Path, connection: str, env: dict[str, str]) -> bool:
    """Register a SuperNode's public key (named after its file) with the
    SuperLink of `connection`; False when the SuperLink already has it."""
    result = subprocess.run(
        [entry_point("flwr"), "supernode", "register", str(public), connection,
         "--name", public.stem],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode == 0:
        return True
    output = result.stdout + result.stderr
    if "already in use" in output:
        return False
    raise DeployError(
        f"registering {public} failed ({result.returncode}):\n{output[-2000:]}"
    )


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
        **task_poll_env(),
    }


def task_poll_env() -> dict[str, str]:
    """Flower's SuperExec task poll, lowered from its 1 s unless the user set
    it: the SuperExecs pollen starts take up a task within 0.1 s."""
    return {TASK_POLL_ENV: os.environ.get(TASK_POLL_ENV, TASK_POLL_SECONDS)}


def start(
    command: list[str], home: Path, log: Path, env: dict[str, str] | None = None
) -> int:
    """Start `command` in its own process group, output to `log`, with
    `env` added to its environment; its PID."""
    home.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        process = subprocess.Popen(
            command,
            env={**flower_env(home), **(env or {})},
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


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the process group `pid` leads, then SIGKILL it after `grace` s;
    then SIGKILL whatever it had started in other process groups (Flower's
    SuperExec starts ServerApps and ClientApps in sessions of their own)."""
    strays = descendants(pid)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        if reaped(pid, wait):
            break
    for stray in strays:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stray, signal.SIGKILL)


def reaped(pid: int, wait: float) -> bool:
    """Whether `pid` ended within `wait` s (reaped when it is our child)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return True
        except ChildProcessError:  # not our child: poll instead
            if not alive(pid):
                return True
        time.sleep(0.1)
    return False


# --- the deployment ----------------------------------------------------------


@dataclass
class Node:
    partition_id: int
    pid: int
    node_config: str
    log: str
    key: str = ""
    prefix: list[str] = field(default_factory=list)  # e.g. `ip netns exec NS`
    executor_pid: int = 0  # its `pollen superexec` (0: Flower's, in the SuperNode)

    @property
    def executor_log(self) -> str:
        return self.log.removesuffix(".log") + "-superexec.log"


@dataclass
class Deployment:
    """What `up` started, as recorded in `DIR/deployment.json`."""

    directory: str
    address: str
    insecure: bool
    superlink_pid: int = 0
    nodes: list[Node] = field(default_factory=list)
    executor: str = "cold"  # records written before warm executors were cold
    threads: int = 0  # torch threads per ClientApp process (0: torch's default)
    host: str = ""  # the address the SuperLink listens on (default: address's host)

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
            raise DeployError(
                f"no deployment in {directory} ({STATE_FILE} missing)"
            ) from None
        except (ValueError, TypeError, KeyError) as err:
            raise DeployError(
                f"{path} is not a pollen deployment record: {err}"
            ) from None

    def running(self) -> list[int]:
        """PIDs of this deployment's processes that are still alive."""
        pids = [self.superlink_pid, *(n.pid for n in self.nodes),
                *(n.executor_pid for n in self.nodes)]  # fmt: skip
        return [pid for pid in pids if pid and alive(pid)]

    def write_flower_config(self) -> None:
        """The connection `flwr run . pollen` uses with FLWR_HOME=flwr_home."""
        lines = ['[superlink]', f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]",
                 f'address = "{self.address}"']  # fmt: skip
        lines.append(
            "insecure = true" if self.insecure else f'root-certificates = "{self.ca}"'
        )
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

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    def node(self, partition_id: int) -> Node:
        for node in self.nodes:
            if node.partition_id == partition_id:
                return node
        known = ", ".join(str(n.partition_id) for n in self.nodes)
        raise DeployError(f"no node with partition-id {partition_id}; nodes: {known}")

    def start_superlink(self, host: str, port: int) -> None:
        command = [
            entry_point("flower-superlink"), "--isolation", "subprocess",
            "--host", host, "--port", str(port),
            "--database", str(self.root / "superlink.db"),
            "--disable-runtime-dependency-installation",
        ]  # fmt: skip
        if self.insecure:
            command.append("--insecure")
        else:
            command += [
                "--ssl-ca-certfile", str(self.ca),
                "--ssl-certfile", str(self.certs / "server.pem"),
                "--ssl-keyfile", str(self.certs / "server.key"),
                "--enable-supernode-auth",
            ]  # fmt: skip
        log = self.root / "logs" / "superlink.log"
        self.superlink_pid = start(command, self.root / "superlink-home", log)
        self._wait_healthy(log)

    def _wait_healthy(self, log: Path) -> None:
        scheme = "http" if self.insecure else "https"
        context = None if self.insecure else ssl.create_default_context(cafile=self.ca)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if not alive(self.superlink_pid):
                raise DeployError(
                    f"flower-superlink exited; the end of {log}:\n{_tail(log)}"
                )
            try:
                with urllib.request.urlopen(
                    f"{scheme}://{self.address}/health", timeout=1.0, context=context
                ) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise DeployError(f"flower-superlink did not answer in {START_SECONDS:.0f} s")

    def start_node(
        self, partition_id: int, node_config: str, prefix: Sequence[str] = ()
    ) -> Node:
        """Start (or restart, with the same key) the SuperNode of `partition_id`,
        its command behind `prefix` (e.g. `ip netns exec NS` for a node in a
        network namespace).

        With authentication its key is registered once; a restarted node
        presents the same key and keeps its node ID."""
        name = f"node-{partition_id}"
        runtime_port = free_port()
        isolation = "process" if self.executor == "warm" else "subprocess"
        command = [
            entry_point("flower-supernode"), "--superlink", self.address,
            "--node-config", node_config, "--isolation", isolation,
            "--host", "127.0.0.1", "--port", str(runtime_port),
        ]  # fmt: skip
        key = self.root / "keys" / name
        if self.insecure:
            command.append("--insecure")
        else:
            if not key.exists():
                register_key(make_node_key(key), CONNECTION, flower_env(self.flwr_home))
            command += ["--root-certificates", str(self.ca),
                        "--auth-supernode-private-key", str(key)]  # fmt: skip
        log = self.root / "logs" / f"{name}.log"
        home = self.root / "nodes" / name
        env = {"OMP_NUM_THREADS": str(self.threads)} if self.threads else {}
        node = Node(
            partition_id, start([*prefix, *command], home, log, env), node_config,
            str(log), "" if self.insecure else str(key), list(prefix),
        )  # fmt: skip
        if self.executor == "warm":
            superexec = [
                entry_point("pollen"), "superexec", "--parent-pid", str(node.pid),
                "--runtime-api-address", f"127.0.0.1:{runtime_port}", "--insecure",
            ]  # fmt: skip
            node.executor_pid = start(
                [*prefix, *superexec], home, Path(node.executor_log), env
            )
        self.nodes = [n for n in self.nodes if n.partition_id != partition_id] + [node]
        self.nodes.sort(key=lambda n: n.partition_id)
        return node

    def online_nodes(self) -> int:
        """How many SuperNodes the SuperLink lists as online."""
        listing = json.loads(self.flwr("supernode", "list", "--format", "json").stdout)
        return sum(1 for n in listing.get("nodes", []) if n.get("status") == "online")

    def wait_online(self, count: int, timeout: float = START_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            if self.online_nodes() >= count:
                return
            if time.monotonic() > deadline:
                raise DeployError(
                    f"only {self.online_nodes()} of {count} SuperNodes came online "
                    f"in {timeout:.0f} s; see the logs in {self.root / 'logs'}"
                )
            time.sleep(0.5)

    def _check_alive(self) -> None:
        """Raise, with the end of its log, for a node process that exited."""
        for node in self.nodes:
            for what, pid, log in (
                ("SuperNode", node.pid, node.log),
                ("its pollen superexec", node.executor_pid, node.executor_log),
            ):
                if pid and not alive(pid):
                    raise DeployError(
                        f"node {node.partition_id}: {what} exited; the end of "
                        f"{log}:\n{_tail(Path(log))}"
                    )


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_config(
    partition_id: int, num_partitions: int, extra: dict[str, str | int | float | bool]
) -> str:
    """`--node-config` text: partition-id, num-partitions, then `extra`."""
    items = {"partition-id": partition_id, "num-partitions": num_partitions, **extra}
    return " ".join(f"{k}={json.dumps(v)}" for k, v in items.items())


def up(
    directory: Path,
    num_nodes: int,
    *,
    host: str = "127.0.0.1",
    port: int = 9093,
    san: Sequence[str] = (),
    insecure: bool = False,
    data_root: str = "",
    node_extra: dict[int, dict[str, str]] | None = None,
    node_prefix: dict[int, list[str]] | None = None,
    executor: str = "warm",
) -> Deployment:
    """Start a SuperLink and `num_nodes` SuperNodes; record them in `directory`.

    `executor` runs each node's ClientApps: "warm" (`pollen superexec` beside
    a SuperNode with `--isolation process`) or "cold" (Flower's SuperExec,
    a fresh process per message). The nodes share this machine's CPUs: each
    ClientApp gets CPUs / `num_nodes` torch threads (at least 1), as the
    simulation gives each client its share, unless OMP_NUM_THREADS is set.

    Node k gets `partition-id=k num-partitions=num_nodes`, `state-dir` under
    `directory/state/node-k` (its client state survives a restart),
    `data-root` when given, and whatever `node_extra[k]` adds or overrides;
    its command runs behind `node_prefix[k]` when given.
    """
    if num_nodes < 1:
        raise DeployError(f"--nodes must be at least 1, got {num_nodes}")
    if executor not in EXECUTORS:
        raise DeployError(
            f"--executor {executor!r}: expected one of {', '.join(EXECUTORS)}"
        )
    directory = directory.expanduser().resolve()
    record = directory / STATE_FILE
    if record.exists():
        running = Deployment.load(directory).running()
        if running:
            raise DeployError(
                f"a deployment is already up in {directory} (PIDs "
                f"{', '.join(map(str, running))}); `pollen deploy down` it first"
            )
    directory.mkdir(parents=True, exist_ok=True)
    address = f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    deployment = Deployment(
        str(directory), address, insecure, executor=executor, host=host
    )
    if "OMP_NUM_THREADS" not in os.environ:
        deployment.threads = max(1, (os.cpu_count() or 1) // num_nodes)
    if not insecure:
        hosts = list(dict.fromkeys([*DEFAULT_HOSTS, host, *san]))
        make_certificates(
            deployment.certs, [h for h in hosts if h not in ("0.0.0.0", "::")]
        )
    deployment.write_flower_config()
    try:
        deployment.start_superlink(host, port)
        deployment.save()
        for k in range(num_nodes):
            extra: dict[str, str] = {
                "state-dir": str(directory / "state" / f"node-{k}")
            }
            if data_root:
                extra["data-root"] = str(Path(data_root).expanduser().resolve())
            extra.update((node_extra or {}).get(k, {}))
            config = node_config(k, num_nodes, extra)
            deployment.start_node(k, config, (node_prefix or {}).get(k, ()))
            deployment.save()
        deployment.wait_online(num_nodes)
    except BaseException:
        down(directory)
        raise
    return deployment


def down(directory: Path) -> list[int]:
    """Stop every process `up` recorded (SuperNodes first); the PIDs stopped.

    Files stay: logs, the state database, certificates, keys and node state,
    so a later `up` in the same directory keeps the clients' state."""
    deployment = Deployment.load(directory.expanduser().resolve())
    stopped = deployment.running()
    for node in deployment.nodes:
        stop_node(node)
    stop(deployment.superlink_pid)
    return stopped


def stop_node(node: Node) -> None:
    """Stop a SuperNode's warm executor (and its tasks), then the SuperNode."""
    if node.executor_pid:
        stop(node.executor_pid)
    stop(node.pid)


def restart_superlink(directory: Path) -> int:
    """Stop the SuperLink if it runs and start it again with the same state
    database, certificates, address and port; its PID. The SuperNodes
    reconnect by themselves (they retry), with the node IDs the database
    keeps for their registered keys; a run it was serving ended with it and
    continues with `resume`."""
    deployment = Deployment.load(directory.expanduser().resolve())
    stop(deployment.superlink_pid)
    address_host, _, port = deployment.address.rpartition(":")
    deployment.start_superlink(deployment.host or address_host, int(port))
    deployment.save()
    return deployment.superlink_pid


def restart_node(directory: Path, partition_id: int) -> Node:
    """Stop the SuperNode of `partition_id` if it runs, start it again with
    its recorded node config and key."""
    deployment = Deployment.load(directory.expanduser().resolve())
    old = deployment.node(partition_id)
    stop_node(old)
    node = deployment.start_node(partition_id, old.node_config, old.prefix)
    deployment.save()
    return node


def status(directory: Path) -> str:
    """One line per process (alive or not), and the SuperLink's node list."""
    deployment = Deployment.load(directory.expanduser().resolve())
    state = {True: "running", False: "stopped"}
    lines = [
        f"deployment {deployment.root} at {deployment.address} "
        f"({'insecure' if deployment.insecure else 'TLS + SuperNode authentication'}; "
        f"{deployment.executor} ClientApp executor)",
        f"superlink  pid {deployment.superlink_pid:>7}  "
        f"{state[alive(deployment.superlink_pid)]}",
    ]
    for node in deployment.nodes:
        lines.append(
            f"node {node.partition_id:<5} pid {node.pid:>7}  {state[alive(node.pid)]:8} "
            f"{node.node_config}"
        )
        if node.executor_pid:
            lines.append(
                f"  executor  pid {node.executor_pid:>7}  "
                f"{state[alive(node.executor_pid)]}"
            )
    if alive(deployment.superlink_pid):
        lines.append(f"online SuperNodes: {deployment.online_nodes()}")
    lines.append(
        f"submit runs with: pollen run . --deployment {deployment.root}  "
        f"(or FLWR_HOME={deployment.flwr_home} flwr run . {CONNECTION} --stream)"
    )
    return "\n".join(lines)
