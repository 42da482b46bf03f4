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
SuperNode's key pair, `pollen deploy register` registers the public keys;
docs/tutorials/three-machines.md uses them step by step.

One command at a time changes a deployment: `up`, `down` and `restart`
hold an exclusive `flock` on `DIR/deploy.lock` while they start and stop
processes and rewrite `deployment.json`, so a second one refuses at once,
naming the holder's PID, and writes nothing. `status` and runs submitted to
the deployment only read the record (written atomically) and take no lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import locks
from ..files import write_json
from ..flower_waits import POLL_SECONDS
from .certificates import make_certificates, make_node_key
from .flower import flower_env, start_superlink
from .long_poll import PULL_HOLD_SECONDS
from .processes import (
    alive,
    another_listens,
    descendants,
    entry_point,
    free_port,
    group_is_ours,
    log_tail,
    port_problem,
    recorded_runs,
    start,
    start_times,
    stop,
    stop_signals_deferred,
)

CONNECTION = "pollen"
STATE_FILE = "deployment.json"
LOCK_FILE = "deploy.lock"  # held by the one command changing the deployment
EXECUTORS = ("warm", "cold")
# Where the SuperLink keeps its state: memory (Flower's default; rounds of 4 and 8
# nodes 1.3 to 1.6x faster than with the file, docs/lab-notes/deployment.md, but a
# restart forgets everything) or a SQLite file (`superlink.db`: a restarted SuperLink keeps the
# registered SuperNodes and the runs).
SUPERLINK_STATES = ("memory", "file")
IN_MEMORY_DATABASE = (
    ":flwr-in-memory:"  # flwr.supercore.constant.FLWR_IN_MEMORY_DB_NAME
)
ONLINE_SECONDS = 60.0  # for every SuperNode `up` started to be listed online
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
ANY_ADDRESSES = ("0.0.0.0", "::")  # a SuperLink listening on every interface


class DeployError(RuntimeError):
    """A deployment cannot be brought up, inspected or stopped as asked."""


class DeployRefused(DeployError):
    """Refused before anything started, for a reason to fix first (another
    command changes the deployment, one runs there already, the port is
    taken): the command exits as for input to fix."""


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
    # SuperNodes' sleep right after a message (0: Flower's own waits; records
    # from before `pollen supernode` ran Flower's)
    node_poll: float = 0.0
    superlink_state: str = "file"  # one of SUPERLINK_STATES (older records: file)
    # how long the SuperLink holds a pull that finds nothing (0: Flower's
    # `flower-superlink`; records from before `pollen superlink`)
    pull_hold: float = 0.0
    # each recorded PID's start time (`processes.start_times`): a PID the system
    # gave to another process since is not this deployment's (older records: {})
    started: dict[str, int] = field(default_factory=dict)

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
        """Write the record, with the start time of each process it names."""
        self.started = start_times(self._pids(), self.started)
        write_json(self.root / STATE_FILE, asdict(self))

    def _pids(self) -> list[int]:
        return [pid for pid in (self.superlink_pid, *(n.pid for n in self.nodes),
                                *(n.executor_pid for n in self.nodes)) if pid]  # fmt: skip

    def ours(self, pid: int) -> bool:
        """Whether `pid` runs and is the process this deployment started (not
        one the PID was reused for after it ended: a reboot, an old record)."""
        return recorded_runs(pid, self.started)

    def stop(self, pid: int) -> None:
        """Stop `pid`'s process group, unless the PID now runs another
        program's process (`processes.group_is_ours`)."""
        if group_is_ours(pid, self.ours(pid)):
            stop(pid)

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
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise DeployError(
                f"{path} is not a pollen deployment record: {err}"
            ) from None

    def running(self) -> list[int]:
        """PIDs of this deployment's processes that are still alive."""
        return [pid for pid in self._pids() if self.ours(pid)]

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

    @property
    def superlink_log(self) -> Path:
        return self.root / "logs" / "superlink.log"

    def node(self, partition_id: int) -> Node:
        for node in self.nodes:
            if node.partition_id == partition_id:
                return node
        known = ", ".join(str(n.partition_id) for n in self.nodes)
        raise DeployError(f"no node with partition-id {partition_id}; nodes: {known}")

    def start_superlink(self, host: str, port: int) -> None:
        """Start the SuperLink on `host:port` and return once it answers,
        its PID recorded as soon as it starts (a failure or Ctrl-C during
        the wait stops it and leaves the PID of a stopped process). Refused
        when what answered is not this SuperLink but another program that
        took the port while it started (it exits on `address already in
        use`)."""
        database = (
            IN_MEMORY_DATABASE
            if self.superlink_state == "memory"
            else str(self.root / "superlink.db")
        )
        options = ["--database", database]
        if self.insecure:
            options.append("--insecure")
        else:
            options += [
                "--ssl-ca-certfile", str(self.ca),
                "--ssl-certfile", str(self.certs / "server.pem"),
                "--ssl-keyfile", str(self.certs / "server.key"),
                "--enable-supernode-auth",
            ]  # fmt: skip
        home = self.root / "superlink-home"
        home.mkdir(parents=True, exist_ok=True)

        def record(pid: int) -> None:
            self.superlink_pid = pid

        superlink = start_superlink(
            options, host=host, port=port, address=self.address,
            env=flower_env(home), log=self.superlink_log,
            ca=None if self.insecure else self.ca, started=record,
            pull_hold=self.pull_hold,
        )  # fmt: skip
        if another_listens(superlink.pid, port):
            stop(superlink.pid)
            raise DeployError(
                f"another program took port {port} while the SuperLink (pid "
                f"{superlink.pid}) started, and answered its health check; stop "
                "that program, or choose another --port"
            )

    def start_node(
        self,
        partition_id: int,
        node_config: str,
        prefix: Sequence[str] = (),
        new_superlink: bool = False,
    ) -> Node:
        """Start (or restart, with the same key) the SuperNode of `partition_id`,
        its command behind `prefix` (e.g. `ip netns exec NS` for a node in a
        network namespace).

        With authentication its key is made once and registered with each
        SuperLink `up` starts (`new_superlink`: one with its state in memory
        knows no key, so a directory brought up again re-registers the keys
        it keeps); a restarted node presents the same key and keeps its node
        ID."""
        name = f"node-{partition_id}"
        runtime_port = free_port()
        isolation = "process" if self.executor == "warm" else "subprocess"
        supernode = (
            [entry_point("pollen"), "supernode", "--poll-interval", str(self.node_poll)]
            if self.node_poll
            else [entry_point("flower-supernode")]
        )
        command = [
            *supernode, "--superlink", self.address,
            "--node-config", node_config, "--isolation", isolation,
            "--host", "127.0.0.1", "--port", str(runtime_port),
        ]  # fmt: skip
        key = self.root / "keys" / name
        if self.insecure:
            command.append("--insecure")
        else:
            if not key.exists():
                make_node_key(key)
                new_superlink = True
            if new_superlink:
                public = key.with_name(f"{key.name}.pub")
                register_key(public, CONNECTION, flower_env(self.flwr_home))
            command += ["--root-certificates", str(self.ca),
                        "--auth-supernode-private-key", str(key)]  # fmt: skip
        log = self.root / "logs" / f"{name}.log"
        home = self.root / "nodes" / name
        env = {"OMP_NUM_THREADS": str(self.threads)} if self.threads else {}
        node = Node(
            partition_id, _start([*prefix, *command], home, log, env), node_config,
            str(log), "" if self.insecure else str(key), list(prefix),
        )  # fmt: skip
        # recorded before its executor starts: a failure there stops it too
        self.nodes = [n for n in self.nodes if n.partition_id != partition_id] + [node]
        self.nodes.sort(key=lambda n: n.partition_id)
        if self.executor == "warm":
            superexec = [
                entry_point("pollen"), "superexec", "--parent-pid", str(node.pid),
                "--poll-interval", str(self.node_poll),
                "--runtime-api-address", f"127.0.0.1:{runtime_port}", "--insecure",
            ]  # fmt: skip
            node.executor_pid = _start(
                [*prefix, *superexec], home, Path(node.executor_log), env
            )
        return node

    def online_nodes(self) -> int:
        """How many SuperNodes the SuperLink lists as online."""
        listing = json.loads(self.flwr("supernode", "list", "--format", "json").stdout)
        return sum(1 for n in listing.get("nodes", []) if n.get("status") == "online")

    def wait_online(self, count: int, timeout: float = ONLINE_SECONDS) -> None:
        """Return once the SuperLink lists `count` SuperNodes online and it
        still runs; raise at once, with the end of its log, when one of
        this deployment's processes exits meanwhile, and after `timeout` s."""
        deadline = time.monotonic() + timeout
        while (online := self._online_while_alive()) < count:
            if time.monotonic() > deadline:
                raise DeployError(
                    f"only {online} of {count} SuperNodes came online "
                    f"in {timeout:.0f} s; see the logs in {self.root / 'logs'}"
                )
            time.sleep(0.5)

    def _online_while_alive(self) -> int:
        """`online_nodes`, checked on both sides by `_check_alive`: the
        SuperLink that lists the nodes must be this deployment's and still
        run when it has listed them (a SuperLink that exited, e.g. on
        `address already in use`, is named as such, not as a failed `flwr`)."""
        self._check_alive()
        try:
            online = self.online_nodes()
        except DeployError:
            self._check_alive()
            raise
        self._check_alive()
        return online

    def _check_alive(self) -> None:
        """Raise, with the end of its log, for a process of this deployment
        (the SuperLink, a node's) that exited."""
        if not self.ours(self.superlink_pid):
            raise DeployError(
                f"the SuperLink (pid {self.superlink_pid}) exited; the end of "
                f"{self.superlink_log}:\n{log_tail(self.superlink_log)}"
            )
        for node in self.nodes:
            for what, pid, log in (
                ("SuperNode", node.pid, node.log),
                ("its pollen superexec", node.executor_pid, node.executor_log),
            ):
                if pid and not alive(pid):
                    raise DeployError(
                        f"node {node.partition_id}: {what} exited; the end of "
                        f"{log}:\n{log_tail(Path(log))}"
                    )


def _start(command: list[str], home: Path, log: Path, env: dict[str, str]) -> int:
    """Start a node's process with its own Flower `home` (and `env` on top),
    output to `log`; its PID."""
    home.mkdir(parents=True, exist_ok=True)
    return start(command, env={**flower_env(home), **env}, log=log).pid


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
    node_poll: float = POLL_SECONDS,
    superlink_state: str = "memory",
    pull_hold: float = PULL_HOLD_SECONDS,
) -> Deployment:
    """Start a SuperLink and `num_nodes` SuperNodes; record them in `directory`.

    `superlink_state` is "memory" (Flower's default: faster rounds, nothing
    survives a restart) or "file" (`superlink.db`, kept across
    `restart_superlink`).
    `executor` runs each node's ClientApps: "warm" (`pollen superexec` beside
    a SuperNode with `--isolation process`) or "cold" (Flower's SuperExec,
    a fresh process per message). Each SuperNode is `pollen supernode`,
    which sleeps `node_poll` seconds right after a message, longer as it
    stays idle (0: `flower-supernode`, with Flower's 3 s idle sleep and 0.5 s
    reply checks). The SuperLink is `pollen superlink`, which holds a
    node's pull that finds nothing up to `pull_hold` seconds, until a
    message for the node and its objects are pushed (0: `flower-superlink`,
    which answers at once). The nodes share this machine's CPUs: each
    ClientApp gets CPUs / `num_nodes` torch threads (at least 1), as the
    simulation gives each client its share, unless OMP_NUM_THREADS is set.

    Node k gets `partition-id=k num-partitions=num_nodes`, `state-dir` under
    `directory/state/node-k` (its client state survives a restart),
    `data-root` when given, and whatever `node_extra[k]` adds or overrides;
    its command runs behind `node_prefix[k]` when given.

    It holds the directory (`exclusive`) from before its first file until it
    returns, and returns only once the SuperLink answers and every node is
    online; whatever fails, what it started is stopped.
    """
    _check_options(num_nodes, executor, superlink_state)
    directory = _made(directory)
    with exclusive(directory, "up"):
        _free_directory(directory)
        if problem := port_problem(host, port):
            raise DeployRefused(
                f"the SuperLink cannot listen on {problem}: another program (or "
                f"deployment) holds port {port}; stop it, or choose another --port"
            )
        reach = "127.0.0.1" if host in ANY_ADDRESSES else host
        address = f"[{reach}]:{port}" if ":" in reach else f"{reach}:{port}"  # IPv6
        deployment = Deployment(
            str(directory), address, insecure, executor=executor, host=host,
            node_poll=node_poll, superlink_state=superlink_state,
            pull_hold=pull_hold, threads=_client_threads(num_nodes),
        )  # fmt: skip
        if not insecure:
            make_certificates(deployment.certs, _certificate_hosts(host, san))
        deployment.write_flower_config()
        nodes = _NodeOptions(data_root, node_extra or {}, node_prefix or {})
        _start_processes(deployment, host, port, num_nodes, nodes)
    return deployment


def _check_options(num_nodes: int, executor: str, superlink_state: str) -> None:
    """Refuse, before anything is written, options `up` cannot start."""
    if num_nodes < 1:
        raise DeployError(f"--nodes must be at least 1, got {num_nodes}")
    if superlink_state not in SUPERLINK_STATES:
        raise DeployError(
            f"--superlink-state {superlink_state!r}: expected one of "
            f"{', '.join(SUPERLINK_STATES)}"
        )
    if executor not in EXECUTORS:
        raise DeployError(
            f"--executor {executor!r}: expected one of {', '.join(EXECUTORS)}"
        )


def _made(directory: Path) -> Path:
    """`directory`, resolved and made (where `up` holds its lock)."""
    directory = directory.expanduser().resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DeployRefused(
            f"--dir {directory}: cannot make it ({err.strerror or err}); it must "
            "be a folder this user can write"
        ) from None
    return directory


def _free_directory(directory: Path) -> None:
    """Refuse a `directory` whose recorded deployment still runs: `up`
    would lose track of its processes."""
    if (directory / STATE_FILE).exists():
        running = Deployment.load(directory).running()
        if running:
            raise DeployRefused(
                f"a deployment is already up in {directory} (PIDs "
                f"{', '.join(map(str, running))}); `pollen deploy down` it first"
            )


@contextlib.contextmanager
def exclusive(directory: Path, action: str) -> Iterator[None]:
    """Hold `directory/deploy.lock` (`locks.held`) while `action` (up, down,
    restart) starts or stops the deployment's processes and rewrites its
    record: two at once would lose track of processes (a `down` during an
    `up` stops what was recorded so far while `up` starts more; two `up`s
    start two SuperLinks on one port and write one record). A second
    command is refused at once, naming the holder, before it writes
    anything."""
    stack = contextlib.ExitStack()
    try:
        say = stack.enter_context(locks.held(directory / LOCK_FILE))
    except locks.LockHeld as held:
        raise DeployRefused(
            f"another `pollen deploy {held.holder.doing or '...'}` (pid "
            f"{held.holder.pid}) is changing the deployment in {directory}; wait "
            "for it to end (a stopped `up` stops what it started), then try again"
        ) from None
    except OSError as err:
        raise DeployRefused(
            f"--dir {directory}: cannot hold a deployment there "
            f"({err.strerror or err}); it must be a folder this user can write"
        ) from None
    with stack:
        say(action)
        yield


@contextlib.contextmanager
def _held_record(directory: Path, action: str) -> Iterator[Deployment]:
    """The deployment recorded in `directory`, read while `action` holds it
    (`exclusive`), so no other command changes it meanwhile. A directory
    without a lock file is first checked to hold a record: a mistyped
    `--dir` gets no lock file."""
    directory = directory.expanduser().resolve()
    if not (directory / LOCK_FILE).exists():
        Deployment.load(directory)  # no record: says so
    with exclusive(directory, action):
        yield Deployment.load(directory)


def _client_threads(num_nodes: int) -> int:
    """Torch threads per ClientApp process: this machine's CPUs shared among
    the nodes (at least 1), or 0 (torch's default) where OMP_NUM_THREADS is
    set: the user's setting stands."""
    if "OMP_NUM_THREADS" in os.environ:
        return 0
    return max(1, (os.cpu_count() or 1) // num_nodes)


def _certificate_hosts(host: str, san: Sequence[str]) -> list[str]:
    """The SuperLink certificate's names: this machine's, the address it
    listens on and `san`, once each; a wildcard address names no host."""
    hosts = list(dict.fromkeys([*DEFAULT_HOSTS, host, *san]))
    return [h for h in hosts if h not in ANY_ADDRESSES]


@dataclass(frozen=True)
class _NodeOptions:
    """What `up` gives its nodes beyond their partition: every node's
    `data_root` ("" for none), node k's `extra[k]` config and its command's
    `prefix[k]` (e.g. `ip netns exec NS`)."""

    data_root: str
    extra: Mapping[int, Mapping[str, str]]
    prefix: Mapping[int, Sequence[str]]

    def config(self, directory: Path, k: int) -> dict[str, str]:
        """Node k's config beside its partition: its `state-dir` under
        `directory` (its client state survives a restart), the data root,
        then whatever `extra[k]` adds or overrides."""
        config = {"state-dir": str(directory / "state" / f"node-{k}")}
        if self.data_root:
            config["data-root"] = str(Path(self.data_root).expanduser().resolve())
        config.update(self.extra.get(k, {}))
        return config


def _start_processes(
    deployment: Deployment, host: str, port: int, num_nodes: int, nodes: _NodeOptions
) -> None:
    """Start the SuperLink, then the nodes, recording each process as it
    starts, and wait for every node to come online. When anything fails
    (Ctrl-C too) what started is recorded, with each process's start time,
    and stopped (a second Ctrl-C waits for that), so the record says that
    nothing runs, and so is a process started without a recorded PID
    (`_unrecorded`); the first failure is raised, not one of the clean-up."""
    try:
        deployment.start_superlink(host, port)
        deployment.save()
        for k in range(num_nodes):
            config = node_config(k, num_nodes, nodes.config(deployment.root, k))
            deployment.start_node(
                k, config, nodes.prefix.get(k, ()), new_superlink=True
            )
            deployment.save()
        deployment.wait_online(num_nodes)
    except BaseException:
        if deployment.superlink_pid:  # something started: record it, stop it
            with stop_signals_deferred():
                with contextlib.suppress(OSError):  # a full disk: stop them still
                    deployment.save()
                _stop_all(deployment)
                for pid in _unrecorded(deployment):
                    stop(pid)
        raise


def _unrecorded(deployment: Deployment) -> list[int]:
    """Processes this one started for `deployment` that its record lacks:
    those below it leading a session of their own (as `processes.start`
    starts them) whose Flower home is in the deployment's directory. A
    signal that interrupts `Popen` right after its fork leaves such a
    process running, its PID never returned."""
    recorded = set(deployment._pids())
    home = f"FLWR_HOME={deployment.root}{os.sep}".encode()
    found = []
    for pid in descendants(os.getpid()):
        try:
            if pid in recorded or os.getsid(pid) != pid:
                continue
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile
            continue
        if any(entry.startswith(home) for entry in environment):
            found.append(pid)
    return found


def down(directory: Path) -> list[int]:
    """Stop every process `up` recorded (SuperNodes first); the PIDs stopped.

    Files stay: logs, the state database, certificates, keys and node state,
    so a later `up` in the same directory keeps the clients' state."""
    with _held_record(directory, "down") as deployment:
        return _stop_all(deployment)


def _stop_all(deployment: Deployment) -> list[int]:
    """Stop the SuperNodes, then the SuperLink; the PIDs that ran."""
    stopped = deployment.running()
    for node in deployment.nodes:
        stop_node(deployment, node)
    deployment.stop(deployment.superlink_pid)
    return stopped


def stop_node(deployment: Deployment, node: Node) -> None:
    """Stop a SuperNode's warm executor (and its tasks), then the SuperNode."""
    deployment.stop(node.executor_pid)
    deployment.stop(node.pid)


def restart_superlink(directory: Path) -> int:
    """Stop the SuperLink if it runs and start it again with the same state
    database, certificates, address and port; its PID. The SuperNodes
    reconnect by themselves (they retry), with the node IDs the database
    keeps for their registered keys; a run it was serving ended with it and
    continues with `resume`."""
    with _held_record(directory, "restart") as deployment:
        if deployment.superlink_state == "memory":
            raise DeployError(
                "this deployment's SuperLink keeps its state in memory "
                "(--superlink-state memory): restarted, it would have forgotten the "
                "registered SuperNodes and the runs; `pollen deploy down` and `up` "
                "instead, or `up --superlink-state file` for a SuperLink that restarts"
            )
        deployment.stop(deployment.superlink_pid)
        address_host, _, port = deployment.address.rpartition(":")
        host = deployment.host or address_host.strip("[]")
        deployment.start_superlink(host, int(port))
        deployment.save()
        return deployment.superlink_pid


def restart_node(directory: Path, partition_id: int) -> Node:
    """Stop the SuperNode of `partition_id` if it runs, start it again with
    its recorded node config and key."""
    with _held_record(directory, "restart") as deployment:
        old = deployment.node(partition_id)
        stop_node(deployment, old)
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
        f"{deployment.executor} ClientApp executor; SuperLink state in "
        f"{deployment.superlink_state}; "
        + (
            f"SuperNodes poll every {deployment.node_poll} s after a message"
            if deployment.node_poll
            else "Flower's SuperNode waits"
        )
        + "; "
        + (
            f"the SuperLink holds an empty pull up to {deployment.pull_hold:g} s"
            if deployment.pull_hold
            else "Flower's SuperLink answers every pull at once"
        )
        + ")",
        f"superlink  pid {deployment.superlink_pid:>7}  "
        f"{state[deployment.ours(deployment.superlink_pid)]}",
    ]
    for node in deployment.nodes:
        lines.append(
            f"node {node.partition_id:<5} pid {node.pid:>7}  {state[deployment.ours(node.pid)]:8} "
            f"{node.node_config}"
        )
        if node.executor_pid:
            lines.append(
                f"  executor  pid {node.executor_pid:>7}  "
                f"{state[deployment.ours(node.executor_pid)]}"
            )
    if deployment.ours(deployment.superlink_pid):
        lines.append(f"online SuperNodes: {deployment.online_nodes()}")
    lines.append(
        f"submit runs with: pollen run . --deployment {deployment.root}  "
        f"(or FLWR_HOME={deployment.flwr_home} flwr run . {CONNECTION} --stream)"
    )
    return "\n".join(lines)
