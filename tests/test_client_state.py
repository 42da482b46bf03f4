"""Client state on the client's disk: what a resumed run reads back, and what
it must never read (state from rounds the resumed run plays again)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from pollen import client_app
from pollen.files import write_json
from pollen.protocol import CLIENT, STATE_DIR
from pollen.settings import Settings
from pollen.task.client_state import (
    KEEP_FROM,
    RESUME_ROUND,
    RUN_NAME,
    ClientStateError,
    ClientStateStore,
    export_state,
    held_bytes,
    import_state,
    server_config,
    store_for,
    tag_new_run,
)
from pollen.task.models import build_model
from pollen.task.sharing import Sharing
from tests.test_sharing import run_config

pytestmark = pytest.mark.usefixtures("task_identity")


def state(value: float) -> dict[str, np.ndarray]:
    return {"h/array/w": np.full(3, value, np.float32)}


def rounds(store: ClientStateStore, client: int) -> list[tuple[int, int]]:
    return [(f.round, f.run_id) for f in store._files(client)]


def test_records_round_trip_with_dtypes() -> None:
    records = {
        "local-3": ArrayRecord({"bn.mean": Array(np.arange(3, dtype=np.float32))}),
        "feddyn-h-3": ArrayRecord({"w": Array(np.ones((2, 2), np.float32))}),
        "dp-steps-3": ConfigRecord({"steps": 42}),
        "local-13": ArrayRecord({"bn.mean": Array(np.zeros(3, np.float32))}),  # another
        "state-round-3": ConfigRecord({"round": 1}),  # the marker stays in memory
    }
    flat = export_state(records, 3)
    assert set(flat) == {
        "local/array/bn.mean",
        "feddyn-h/array/w",
        "dp-steps/config/steps",
    }
    back = import_state(flat, 3)
    assert set(back) == {"local-3", "feddyn-h-3", "dp-steps-3"}
    assert back["dp-steps-3"]["steps"] == 42
    restored = back["local-3"]["bn.mean"].numpy()
    assert restored.dtype == np.float32 and restored.tolist() == [0, 1, 2]


def test_a_scalar_entry_round_trips_as_a_scalar() -> None:
    """FedBN keeps BatchNorm's 0-d `num_batches_tracked` on the client: it
    must come back 0-d, as the model's state dict holds it."""
    counter = ArrayRecord({"bn.num_batches_tracked": Array(np.array(5, np.int64))})
    back = import_state(export_state({"local-3": counter}, 3), 3)
    restored = back["local-3"]["bn.num_batches_tracked"].numpy()
    assert restored.shape == () and restored.dtype == np.int64 and restored == 5


def test_a_resumed_run_never_reads_the_abandoned_future(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path)
    for r in (1, 2, 3, 4):  # run 7 trained rounds 1-4, checkpointed round 2, died
        store.save(0, r, 7, state(r))
    loaded = store.load(0, run_id=8, resume_round=2)  # run 8 resumes after round 2
    assert loaded is not None and loaded[0] == 2 and loaded[1]["h/array/w"][0] == 2
    store.save(0, 3, 8, state(30))  # run 8 replays round 3
    loaded = store.load(0, run_id=8, resume_round=2)
    assert loaded is not None and loaded[1]["h/array/w"][0] == 30
    assert store.forget_abandoned(run_id=8, resume_round=2) == 2  # 7's rounds 3, 4
    assert rounds(store, 0) == [(1, 7), (2, 7), (3, 8)]
    assert store.load(0, run_id=9, resume_round=0) is None  # a fresh run: nothing


def test_state_files_are_private_and_results_are_readable(tmp_path: Path) -> None:
    """A client's h_k and local entries are its own (0600); results written by
    a container's root stay readable on the host (0666 less the umask)."""
    ClientStateStore(tmp_path / "state").save(0, 1, 7, state(1))
    (saved,) = (tmp_path / "state").rglob("*.npz")
    assert saved.stat().st_mode & 0o777 == 0o600
    write_json(tmp_path / "summary.json", {"status": "completed"})
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_prune_keeps_what_a_resume_can_need(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path)
    for r in (1, 3, 5, 6):
        store.save(2, r, 1, state(r))
    store.prune(2, keep_from=4)  # latest checkpoint: round 4, its state is round 3's
    assert rounds(store, 2) == [(3, 1), (5, 1), (6, 1)]
    store.prune(2, keep_from=0)  # no checkpoint yet: nothing can go
    assert len(rounds(store, 2)) == 3


def test_unreadable_state_file_is_a_clear_error(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path)
    path = store.save(1, 1, 1, state(1))
    path.write_bytes(b"not an npz")
    with pytest.raises(
        ClientStateError, match=r"client 1: its state file .* unreadable"
    ):
        store.load(1, run_id=1, resume_round=0)


def message(
    kind: str, arrays: ArrayRecord, client: int, r: int, extra: dict
) -> Message:
    config = ConfigRecord(
        {"lr": 0.05, "server-round": r, CLIENT: client, RUN_NAME: "run", **extra}
    )
    return Message(
        RecordDict({"arrays": arrays, "config": config}),
        dst_node_id=1,
        message_type=kind,
    )


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"strategy": "feddyn", "bn-policy": "shared"}, "server"),
        ({"strategy": "fedavg", "bn-policy": "fedbn"}, "server"),
        ({"strategy": "feddyn", "bn-policy": "silobn"}, "node"),
    ],
    ids=["feddyn-h", "fedbn-local", "node-state-dir"],
)
def test_resumed_client_trains_exactly_as_if_it_never_stopped(
    tmp_path: Path, overrides: dict, where: str
) -> None:
    """Round 2 on a fresh node of a new run that resumes after round 1 gives
    the same reply as round 2 on the node that kept its state in memory."""
    settings = run_config(**overrides)
    model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    sharing = Sharing.of(Settings.from_run_config(settings).sharing_policy, model)
    sent = ArrayRecord({k: model.state_dict()[k] for k in sharing.shared})
    node_config = {STATE_DIR: str(tmp_path / "node")} if where == "node" else {}
    extra = {KEEP_FROM: 1}  # the server's latest checkpoint is round 1's
    if where == "server":
        extra[STATE_DIR] = str(tmp_path / "run" / "client-state")

    first = Context(101, 1, node_config, RecordDict(), settings)
    up = client_app.train(message("train", sent, 1, 1, extra), first)
    theta = up.content["arrays"]
    reference = client_app.train(message("train", theta, 1, 2, extra), first)

    resumed = Context(202, 1, node_config, RecordDict(), settings)  # new run, new node
    again = client_app.train(
        message("train", theta, 1, 2, {**extra, RESUME_ROUND: 1}), resumed
    )
    for name in sharing.shared:
        np.testing.assert_array_equal(
            again.content["arrays"][name].numpy(),
            reference.content["arrays"][name].numpy(),
            err_msg=name,
        )
    cold = Context(303, 1, node_config, RecordDict(), settings)  # no state to read
    fresh = client_app.train(
        message("train", theta, 1, 2, {**extra, RESUME_ROUND: 0}), cold
    )
    assert any(
        not np.array_equal(
            fresh.content["arrays"][n].numpy(), reference.content["arrays"][n].numpy()
        )
        for n in sharing.shared
    )  # the state mattered
    root = tmp_path / ("node/run" if where == "node" else "run/client-state")
    assert sorted(p.name for p in (root / "client-1").iterdir()) == [
        "round-00001.run-101.npz", "round-00002.run-101.npz",
        "round-00002.run-202.npz", "round-00002.run-303.npz",
    ]  # fmt: skip


def test_no_state_dir_means_memory_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = run_config(strategy="feddyn")
    model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    context = Context(1, 1, {}, RecordDict(), settings)
    client_app.train(
        message("train", ArrayRecord(model.state_dict()), 0, 1, {}), context
    )
    assert "feddyn-h-0" in context.state and list(tmp_path.iterdir()) == []


def test_a_state_dir_that_cannot_be_written_does_not_fail_training(
    tmp_path: Path, caplog
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    settings = run_config(strategy="feddyn")
    model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    context = Context(1, 1, {}, RecordDict(), settings)
    reply = client_app.train(
        message(
            "train",
            ArrayRecord(model.state_dict()),
            0,
            1,
            {STATE_DIR: str(blocked), KEEP_FROM: 0},  # a checkpointing run
        ),
        context,
    )
    assert "arrays" in reply.content and "feddyn-h-0" in context.state
    assert "cannot write its state" in caplog.text
    assert blocked.read_text() == "not a directory"


def test_state_spilled_beyond_the_bound_trains_as_if_kept_in_memory(
    tmp_path: Path,
) -> None:
    """One node serving three FedDyn clients twice: with a bound below one
    client's h_k, every other client's h_k goes to disk after each message
    and comes back when it is next sampled; the replies are the same, bit for
    bit, as with everything in memory."""
    settings = run_config(strategy="feddyn", **{"num-clients": 3})
    model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    sent = ArrayRecord(model.state_dict())
    extra = {STATE_DIR: str(tmp_path / "client-state")}  # no checkpoints
    kept = Context(2, 1, {}, RecordDict(), settings)  # another run: its own files
    bounded = Context(1, 1, {}, RecordDict(), {**settings, "state-memory-mib": 0.01})
    for r in (1, 2):
        for client in (0, 1, 2):
            msg = message("train", sent, client, r, extra)
            reference = client_app.train(msg, kept)
            reply = client_app.train(msg, bounded)
            for name in reference.content["arrays"]:
                np.testing.assert_array_equal(
                    reply.content["arrays"][name].numpy(),
                    reference.content["arrays"][name].numpy(),
                    err_msg=f"round {r} client {client} {name}",
                )
            assert list(held_bytes(bounded)) == [client]  # the others spilled
    assert sorted(held_bytes(kept)) == [0, 1, 2]
    files = sorted(p.relative_to(tmp_path / "client-state").as_posix()
                   for p in (tmp_path / "client-state").rglob("*.npz"))  # fmt: skip
    # spill files, this run's alone; client 2's from round 1 stays while its
    # state is in memory (should round 2's reply fail, that file is its state)
    assert files == [
        "client-0/round-00002.run-1.spill.npz", "client-1/round-00002.run-1.spill.npz",
        "client-2/round-00001.run-1.spill.npz",
    ]  # fmt: skip
    store = ClientStateStore(tmp_path / "client-state")
    assert store.remove_spills(run_id=2) == 0  # another run's: none
    assert store.remove_spills(run_id=1) == 3  # at the run's end
    assert not list((tmp_path / "client-state").rglob("*.npz"))


def test_a_resumed_run_never_reads_another_runs_spill_files(tmp_path: Path) -> None:
    """A spill file holds state that may have moved on in the memory of the
    run that wrote it: a run resumed from a checkpoint at or after its round
    must not read it, and deletes it; a durable file of that round it reads."""
    store = ClientStateStore(tmp_path)
    store.save(1, 3, run_id=7, state=state(1.0), spill=True)
    store.save(2, 3, run_id=7, state=state(2.0))
    assert store.load(1, run_id=7, resume_round=0)[0] == 3  # the run's own
    assert store.load(1, run_id=8, resume_round=5) is None
    assert store.load(2, run_id=8, resume_round=5)[0] == 3
    assert store.forget_abandoned(run_id=8, resume_round=5) == 1
    assert rounds(store, 1) == [] and rounds(store, 2) == [(3, 7)]


def test_two_runs_of_one_name_in_two_output_folders_keep_apart_on_a_node(
    tmp_path: Path,
) -> None:
    """A node's own state-dir held every run named "exp" in one folder, so a
    fresh run of that name elsewhere deleted an interrupted one's state at
    its start query, or its resume read the other's. A run directory is
    tagged when made, and its nodes' folders carry the tag: the same for its
    resume and after the directory moves; a run made before tags keeps its
    name alone, so its resume finds what its nodes wrote."""
    node = Context(1, 1, {STATE_DIR: str(tmp_path / "node")}, RecordDict(), {})
    a, b = tmp_path / "results-a" / "exp", tmp_path / "results-b" / "exp"
    for run_dir in (a, b):
        run_dir.mkdir(parents=True)
        tag_new_run(run_dir)
    first = store_for(node, server_config(a, "exp", 0, checkpoints=True))
    again = store_for(node, server_config(a, "exp", 2, checkpoints=True))
    other = store_for(node, server_config(b, "exp", 0, checkpoints=True))
    assert first.root == again.root != other.root
    moved = tmp_path / "moved" / "exp"
    a.parent.rename(moved.parent)
    assert store_for(node, server_config(moved, "exp", 2, checkpoints=True)).root == (
        first.root
    )
    older = tmp_path / "results-c" / "exp"  # made before run directories had tags
    older.mkdir(parents=True)
    legacy = store_for(node, server_config(older, "exp", 2, checkpoints=True))
    assert legacy.root == tmp_path / "node" / "exp"
