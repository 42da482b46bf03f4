"""A client's private state on its own disk, so that a resumed run continues it.

What a client keeps between rounds (FedBN/SiloBN/FedSA local entries,
FedDyn's h_k, the DP accountant's step count) lives in `context.state`,
which Flower keeps in memory for one run: a resumed run (a new Flower run)
or a restarted SuperNode starts without it. When the run checkpoints, each
client also writes its state after every round it trains, to

    <root>/client-<c>/round-<r:05d>.run-<run-id>.npz

where the root is `<state-dir>/<run-name>-<tag>` with `state-dir` from the node
config (a SuperNode's own disk) or, without one, the server's
`<run-dir>/client-state` (right when server and clients share a file
system: simulation, a local deployment). The state never leaves the
client's machine through Flower.

A SuperNode restarted during a run has lost `context.state`; with its own
`state-dir` it reads its newest file back and goes on where it was.

A node that serves many clients (a simulation of more clients than nodes)
keeps at most `state-memory-mib` of their state in memory: after each
message, the state of the clients it trained least recently is written to
the store (the node's `state-dir`, else the run's `client-state` folder) and
dropped from `context.state`, to be read back when such a client is next
sampled. Flower ships a node's whole context to the training process with
every message, so the bound also bounds what each message carries. Spill
files are the run's alone (no other run reads them); the server removes
them when the run ends. (The
run's folder is the server's path: right in a simulation or a deployment on
one machine; a remote node that spills without a `state-dir` of its own
writes under that path on its own disk.)

A resumed run continues from the server's checkpoint of round R. Files of
rounds after R written by an earlier run belong to a future that was
abandoned: they are never read and are deleted at the run's start. A client
without in-memory state reads its newest valid file. After each save a
client deletes what no resume can need any more: everything older than its
newest file at or before the server's latest checkpoint.

Files are the checkpoints' pickle-free npz, written to a temporary name and
renamed.
"""

from __future__ import annotations

import contextlib
import io
import re
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log

from ..files import NpzError, read_npz, write_atomic, write_npz
from ..protocol import STATE_DIR

# server config: the run's folder under a node's own state-dir: its name and
# the tag its run directory keeps (`RUN_TAG_FILE`), so two runs of one name in
# two output folders keep apart; a run made before tags, its name alone
RUN_NAME = "run-name"
RUN_TAG_FILE = "node-state-tag"  # in a run directory: 8 hex digits, made with it
RESUME_ROUND = "resume-round"  # server config: the checkpoint this run started from
KEEP_FROM = "keep-from"  # server config: the newest round a resume may start from

# Said by the server at the end of a run whose nodes wrote client state to
# disk to stay within state-memory-mib (benchmarks/scale.py reads it)
SPILLED_LINE = "pollen: %d clients' state went to disk beyond state-memory-mib"
_MARKER = "state-round-"  # context.state: this client's state is in memory
_FILE = re.compile(r"round-(\d{5,})\.run-(\d+)(\.spill)?\.npz")


class ClientStateError(RuntimeError):
    """A client's state file cannot be written or read."""


@dataclass(frozen=True)
class StateFile:
    path: Path
    round: int
    run_id: int
    spill: bool = False  # written only to free memory: this run's alone


class ClientStateStore:
    """Per-client state files under one directory (see module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    def _files(self, client: int) -> list[StateFile]:
        folder = self.root / f"client-{client}"
        if not folder.is_dir():
            return []
        files = []
        for path in folder.iterdir():
            if match := _FILE.fullmatch(path.name):
                files.append(
                    StateFile(path, int(match[1]), int(match[2]), bool(match[3]))
                )
        return sorted(files, key=lambda f: f.round)

    def save(
        self,
        client: int,
        server_round: int,
        run_id: int,
        state: dict[str, np.ndarray],
        spill: bool = False,
    ) -> Path:
        """Write the client's state after `server_round`, atomically; as a
        spill file (`.spill.npz`) when it is written only to free memory."""
        folder = self.root / f"client-{client}"
        suffix = ".spill.npz" if spill else ".npz"
        path = folder / f"round-{server_round:05d}.run-{run_id}{suffix}"
        buffer = io.BytesIO()
        write_npz(buffer, state)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(path, buffer.getvalue(), private=True)  # h_k, local entries
        except OSError as err:
            raise ClientStateError(
                f"client {client}: cannot write its state to {path}: {err}"
            ) from err
        return path

    def load(
        self, client: int, run_id: int, resume_round: int
    ) -> tuple[int, dict[str, np.ndarray]] | None:
        """(round, state) of the client's newest valid file, or None.

        Valid: written by this run, or (not a spill file: an earlier run's
        state after a round may have lived on in its memory) by an earlier
        one at or before the checkpoint this run resumed from.
        """
        valid = [
            f
            for f in self._files(client)
            if f.run_id == run_id or (not f.spill and f.round <= resume_round)
        ]
        if not valid:
            return None
        newest = max(valid, key=lambda f: (f.round, f.run_id == run_id))
        try:
            return newest.round, read_npz(newest.path)
        except (OSError, NpzError) as err:
            raise ClientStateError(
                f"client {client}: its state file {newest.path} is unreadable "
                f"({err}); delete it to start this client's state from scratch"
            ) from err

    def remove_spills(self, run_id: int) -> int:
        """Delete every client's spill files of run `run_id`, which no other
        run reads (at the run's end), and the folders that leaves empty.
        Returns how many clients had spilled."""
        clients = set()
        for f in self._all_files():
            if f.spill and f.run_id == run_id:
                f.path.unlink(missing_ok=True)
                clients.add(f.path.parent)
        for folder in clients:
            with contextlib.suppress(OSError):  # not empty: durable files
                folder.rmdir()
        return len(clients)

    def prune(self, client: int, keep_from: int) -> None:
        """Delete files older than the newest one at or before `keep_from`."""
        files = self._files(client)
        older = [f for f in files if f.round <= keep_from]
        if not older:
            return
        anchor = max(f.round for f in older)
        for f in files:
            if f.round < anchor:
                f.path.unlink(missing_ok=True)

    def forget_abandoned(self, run_id: int, resume_round: int) -> int:
        """Delete every client's files from earlier runs after `resume_round`
        (a resumed run replays those rounds), and their spill files. Returns
        how many went."""
        removed = 0
        for f in self._all_files():
            if f.run_id != run_id and (f.spill or f.round > resume_round):
                f.path.unlink(missing_ok=True)
                removed += 1
        return removed

    def _all_files(self) -> Iterator[StateFile]:
        """Every client's files."""
        if not self.root.is_dir():
            return
        for folder in self.root.glob("client-*"):
            client = folder.name.removeprefix("client-")
            if client.isdigit():
                yield from self._files(int(client))


def export_state(records: dict[str, object], client: int) -> dict[str, np.ndarray]:
    """Flatten the client's records (`<name>-<client>` in `context.state`) into
    named arrays: `<name>/array/<entry>` and `<name>/config/<key>`."""
    suffix = f"-{client}"
    out: dict[str, np.ndarray] = {}
    for key, record in records.items():
        if not key.endswith(suffix) or key.startswith(_MARKER):
            continue
        name = key.removesuffix(suffix)
        if isinstance(record, ArrayRecord):
            for entry in record:
                out[f"{name}/array/{entry}"] = record[entry].numpy()
        elif isinstance(record, ConfigRecord):
            for entry, value in record.items():
                out[f"{name}/config/{entry}"] = np.asarray(value)
    return out


def import_state(
    arrays: dict[str, np.ndarray], client: int
) -> dict[str, ArrayRecord | ConfigRecord]:
    """The `context.state` records `export_state` flattened."""
    grouped: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for path, value in arrays.items():
        name, kind, entry = path.split("/", 2)
        grouped.setdefault((name, kind), {})[entry] = value
    records: dict[str, ArrayRecord | ConfigRecord] = {}
    for (name, kind), entries in grouped.items():
        records[f"{name}-{client}"] = (
            ArrayRecord(
                {k: Array(np.asarray(v, order="C")) for k, v in entries.items()}
            )
            if kind == "array"
            else ConfigRecord({k: v.item() for k, v in entries.items()})
        )
    return records


def store_for(
    context: Context, config: Mapping[str, object]
) -> ClientStateStore | None:
    """The node's own `state-dir`, else the server's, else None (memory only)."""
    own = context.node_config.get(STATE_DIR)
    if own:
        return ClientStateStore(Path(str(own)) / str(config.get(RUN_NAME, "run")))
    root = config.get(STATE_DIR)
    return ClientStateStore(str(root)) if root else None


def restore(context: Context, client: int, config: Mapping[str, object]) -> None:
    """Read the client's state from disk into `context.state`, once per run."""
    marker = f"{_MARKER}{client}"
    if marker in context.state:
        return
    store = store_for(context, config)
    loaded = store and store.load(
        client, context.run_id, int(config.get(RESUME_ROUND, 0))
    )
    if loaded:
        for key, record in import_state(loaded[1], client).items():
            context.state[key] = record
    context.state[marker] = ConfigRecord({"round": loaded[0] if loaded else 0})


def persist(
    context: Context, client: int, server_round: int, config: Mapping[str, object]
) -> None:
    """Note the round the client trained in; write its state after it when
    the run checkpoints or the node keeps a `state-dir` of its own.

    A spill file the state was read back from stays: should this message
    fail, Flower keeps the node's context from before it, which lacks the
    client, and that file is then its state. A later spill writes a newer
    one; the server removes the run's spill files when the run ends."""
    context.state[f"{_MARKER}{client}"] = ConfigRecord({"round": server_round})
    if not _durable(context, config):
        return
    store = store_for(context, config)
    if store is None:
        return
    state = export_state(dict(context.state.items()), client)
    if not state:  # plain local training keeps nothing between rounds
        return
    try:
        store.save(client, server_round, context.run_id, state)
    except ClientStateError as err:  # the round's reply is still good: go on
        log(WARNING, "pollen: %s; a resumed run would start this client's state "
            "from scratch (set state-dir in the node config)", err)  # fmt: skip
        return
    store.prune(client, int(config.get(KEEP_FROM, server_round)))


def _durable(context: Context, config: Mapping[str, object]) -> bool:
    """Whether a client's state is written after every round it trains: the
    run checkpoints, or the node keeps a `state-dir` of its own."""
    return KEEP_FROM in config or bool(context.node_config.get(STATE_DIR))


def held_bytes(context: Context) -> dict[int, int]:
    """The bytes of arrays each client keeps in `context.state`."""
    held: dict[int, int] = {}
    for key, record in context.state.items():
        name, _, client = key.rpartition("-")
        if not (name and client.isdigit()) or key.startswith(_MARKER):
            continue
        size = (
            sum(len(record[entry].data) for entry in record)
            if isinstance(record, ArrayRecord)
            else 0
        )
        held[int(client)] = held.get(int(client), 0) + size
    return held


def spill(
    context: Context, config: Mapping[str, object], limit: int, current: int
) -> list[int]:
    """Write the state of the least recently trained clients but `current` to
    the store and drop it from memory, until the node holds at most `limit`
    bytes (see module docstring). Returns the clients spilled."""
    held = held_bytes(context)
    total = sum(held.values())
    if limit <= 0 or total <= limit:
        return []
    store = store_for(context, config)
    if store is None:  # nowhere to put it: keep it, as before the bound
        return []

    def last_trained(client: int) -> int:
        marker = context.state.get(f"{_MARKER}{client}")
        return int(marker["round"]) if isinstance(marker, ConfigRecord) else 0

    spilled = []
    for client in sorted(set(held) - {current}, key=last_trained):
        if total <= limit:
            break
        server_round = last_trained(client)
        state = export_state(dict(context.state.items()), client)
        try:
            store.save(client, server_round, context.run_id, state,
                       spill=not _durable(context, config))  # fmt: skip
        except ClientStateError as err:  # keep it in memory: nothing is lost
            log(WARNING, "pollen: %s; client state stays in memory", err)
            break
        store.prune(client, int(config.get(KEEP_FROM, server_round)))
        for key in [k for k in context.state if k.endswith(f"-{client}")]:
            del context.state[key]  # its records and its marker
        total -= held[client]
        spilled.append(client)
    return spilled


def tag_new_run(run_dir: Path) -> None:
    """Give a new run directory the tag its nodes' state folders carry: it
    moves with the directory and stays for its resumes."""
    write_atomic(run_dir / RUN_TAG_FILE, secrets.token_hex(4) + "\n")


def server_config(
    run_dir: Path, run_name: str, resume_round: int, checkpoints: bool
) -> dict[str, str | int]:
    """What the server tells clients about their state, in every message.

    `STATE_DIR` is where a node without a `state-dir` of its own writes
    (when the run checkpoints, and what it spills). Without checkpoints no
    run can resume from an earlier round, so `KEEP_FROM` is left out and
    nothing is written each round: a node with its own `state-dir` keeps
    only its newest file (what it reads back after a SuperNode restart)."""
    try:
        tag = (run_dir / RUN_TAG_FILE).read_text().strip()
    except OSError:  # a run made before tags: its nodes' folders are its name
        tag = ""
    config: dict[str, str | int] = {
        RUN_NAME: f"{run_name}-{tag}" if tag else run_name,
        RESUME_ROUND: resume_round,
        STATE_DIR: str(run_dir / "client-state"),
    }
    if checkpoints:
        config[KEEP_FROM] = resume_round
    return config
