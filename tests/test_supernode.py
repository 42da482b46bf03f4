"""`pollen supernode`, the SuperExec's poll and the object pulls: Flower's
waits shortened in the one module each belongs to, as the patches of
`pollen.flower_patches` say (whether each applies, or is left out with one
warning line, is tests/test_flower_patches.py's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pollen import flower_waits
from pollen.cli import main


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter: the patches change module globals."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )


def test_the_waits_it_stands_for_are_flowers():
    """What the docs say Flower waits: 3 s idle, 0.5 s reply checks, 1 s first
    object-pull retry, doubling up to 10 s."""
    import inspect

    from flwr.supercore.constant import PULL_BACKOFF_CAP, PULL_INITIAL_BACKOFF
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supernode import start_client_internal as node

    assert "time.sleep(3)" in inspect.getsource(node.start_client_internal)
    assert inspect.getsource(node._push_messages).count("time.sleep(0.5)") == 2
    assert (PULL_INITIAL_BACKOFF, PULL_BACKOFF_CAP) == (1, 10)
    for function in (  # as written (a ServerApp run in this process changes them)
        inflatable_utils.pull_objects,
        inflatable_utils.pull_and_inflate_object_from_tree,
    ):
        source = inspect.getsource(function)
        assert "initial_backoff: float = PULL_INITIAL_BACKOFF" in source
        assert "backoff_cap: float = PULL_BACKOFF_CAP" in source


def test_shortened_in_that_module_only():
    result = run_python(
        "import time\n"
        "from pollen import flower_waits\n"
        "assert flower_waits.shorten_supernode_waits(0.05)\n"
        "from flwr.supernode import start_client_internal as node\n"
        "from flwr.supercore.inflatable import inflatable_utils as utils\n"
        "t = time.monotonic(); node.time.sleep(3); fast = time.monotonic() - t\n"
        "t = time.monotonic(); time.sleep(0.2); real = time.monotonic() - t\n"
        "assert isinstance(node._pull_and_store_message, flower_waits.NotingMessages)\n"
        "assert isinstance(node._push_messages, flower_waits.NotingMessages)\n"
        "print(round(fast, 2), real >= 0.2, node.time.time() > 0,\n"
        "      utils.pull_objects.__kwdefaults__['initial_backoff'],\n"
        "      utils.pull_objects.__kwdefaults__['backoff_cap'],\n"
        "      utils.pull_objects.__kwdefaults__['max_tries_per_object'],\n"
        "      utils.pull_and_inflate_object_from_tree.__kwdefaults__['initial_backoff'])\n"
    )
    assert result.returncode == 0, result.stderr
    fast, real, clock, backoff, cap, tries, clientapp_backoff = result.stdout.split()
    assert float(fast) < 0.5 and real == "True" and clock == "True"
    assert float(backoff) == 0.05 and float(cap) == 1.0  # doubling from 0.05 to 1 s
    assert tries == "None"  # bounded by Flower's max_time (2 h), not 500 tries
    assert float(clientapp_backoff) == 1  # the SuperNode's half only
    assert "warning" not in result.stderr


def test_a_superexec_polls_on_the_clock_in_its_loop_only():
    """The SuperExec loop's `time` is a PollClock (a 1 s poll right after a
    launch lasts 0.05 s) and a launch restarts it; `time` elsewhere is
    Flower's; the interval Flower reads stays its own 1 s."""
    result = run_python(
        "import time\n"
        "from pollen import flower_waits\n"
        "assert flower_waits.shorten_superexec_polls(0.05)\n"
        "from flwr.supercore.superexec import run_superexec as loop\n"
        "assert isinstance(loop._handle_launch_result, flower_waits.NotingMessages)\n"
        "loop.time.last_message = time.monotonic() - 100\n"
        "t = time.monotonic(); loop.time.sleep(0.3); idle = time.monotonic() - t\n"
        "loop._handle_launch_result.step = lambda result, task: None\n"
        "loop._handle_launch_result(None, None)\n"
        "t = time.monotonic(); loop.time.sleep(1); fast = time.monotonic() - t\n"
        "print(round(idle, 2), round(fast, 2), loop._get_task_poll_interval())\n"
    )
    assert result.returncode == 0, result.stderr
    idle, fast, interval = map(float, result.stdout.split())
    assert idle >= 0.3  # idle for 100 s: Flower's own interval (asked 0.3 s)
    assert fast < 0.5  # just after a launch: the poll interval
    assert interval == 1.0
    assert "warning" not in result.stderr


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        ("flower-superexec", "--runtime-api-address"),
        ("flwr-simulation", "Run a Flower Simulation"),
    ],
)
def test_the_shims_on_path_run_flowers_entry_points(
    tmp_path, monkeypatch, command, flag
):
    """`flower_env` puts the shims first on PATH under Flower's command
    names (`flwr-simulation` where runs share a Ray cluster); run by that
    name each is Flower's own entry point (its --help)."""
    import shutil

    from pollen.deployment.flower import flower_env

    monkeypatch.setenv("POLLEN_RAY_SHARE", "2")
    env = flower_env(tmp_path / "home")
    found = shutil.which(command, path=env["PATH"])
    assert found == str(tmp_path / "home" / "bin" / command)
    help_text = subprocess.run(
        [command, "--help"], env=env, capture_output=True, text=True,
        check=True, timeout=60,
    ).stdout  # fmt: skip
    assert flag in help_text
    assert flower_env(tmp_path / "home") == env  # written once, same PATH


def test_a_simulation_not_sharing_a_cluster_runs_flowers_own_entry_point(
    tmp_path, monkeypatch
):
    """Without a share (every run but a comparison's cells on a Ray
    cluster) no `flwr-simulation` of pollen's is on PATH: Flower's runs."""
    import shutil

    from pollen.deployment.flower import flower_env

    monkeypatch.delenv("POLLEN_RAY_SHARE", raising=False)
    env = flower_env(tmp_path / "home")
    assert not (tmp_path / "home" / "bin" / "flwr-simulation").exists()
    found = shutil.which("flwr-simulation", path=env["PATH"])
    assert found == os.path.join(os.path.dirname(sys.executable), "flwr-simulation")


@pytest.mark.parametrize("asked", [None, "1"])
def test_flower_processes_post_telemetry_only_when_asked(asked, tmp_path):
    """What `pollen` runs of Flower's code in its own process (`pollen
    supernode`, `pollen superexec`) and every Flower process it starts
    (`flower_env`) reads FLWR_TELEMETRY_ENABLED=0 unless the user set it."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "FLWR_TELEMETRY_ENABLED"}
    if asked is not None:
        env["FLWR_TELEMETRY_ENABLED"] = asked
    result = subprocess.run(
        [sys.executable, "-c",
         "import contextlib, pathlib, sys\n"
         "from pollen.cli import main\n"
         "from pollen.deployment.flower import flower_env\n"
         "with contextlib.suppress(SystemExit):\n"
         "    main(['supernode', '--help'])\n"
         "from flwr.supercore import telemetry\n"
         f"home = pathlib.Path({str(tmp_path)!r})\n"
         "print(telemetry.FLWR_TELEMETRY_ENABLED, "
         "flower_env(home)['FLWR_TELEMETRY_ENABLED'], file=sys.stderr)\n"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    expected = asked or "0"
    assert result.stderr.split() == [expected, expected]


@pytest.mark.parametrize("value", ["-1", "5", "0.001", "soon"])
def test_poll_interval_is_checked(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["supernode", "--poll-interval", value, "--insecure"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"{value!r}: expected seconds from 0.01 to 3, or 0 for Flower's own waits"
        in err
    )
    with pytest.raises(SystemExit):
        main(["deploy", "up", "--poll-interval", value])
    assert "expected seconds from 0.01 to 3" in capsys.readouterr().err


class FakeTime:
    """`time` for PollClock: a settable clock, and the sleeps asked of it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_poll_clock_waits_the_interval_after_a_message_then_a_share_of_the_wait(
    monkeypatch,
):
    """By hand, poll 0.1 s and share 0.05: 1 s after a message a 3 s sleep
    lasts 0.1 s; after 10 s, 0.5 s; after 100 s, Flower's 3 s; a 0.5 s reply
    check never lasts longer than 0.5 s."""
    fake = FakeTime()
    monkeypatch.setattr(flower_waits, "time", fake)
    clock = flower_waits.PollClock(0.1, share=0.05)
    for since, asked in ((1, 3), (10, 3), (100, 3), (100, 0.5), (0, 0.5)):
        clock.last_message = fake.now - since
        clock.sleep(asked)
    assert fake.slept == [0.1, pytest.approx(0.5), 3, 0.5, 0.1]
    clock.message_seen()
    clock.sleep(3)
    assert fake.slept[-1] == 0.1


def test_a_pull_the_superlink_held_counts_as_waited(monkeypatch):
    """By hand, poll 0.1 s: an empty pull held 20 s (at least
    HELD_PULL_SECONDS) leaves nothing of the next sleep (it would last
    0.05 x 21 = 1.05 s); one answered in 0.04 s leaves the whole 0.1 s, as
    does one that found a message."""
    fake = FakeTime()
    monkeypatch.setattr(flower_waits, "time", fake)
    clock = flower_waits.PollClock(0.1, share=0.05)

    def pull_taking(seconds: float, found: int | None = None):
        def step() -> int | None:
            fake.now += seconds
            return found

        return flower_waits.NotingMessages(step, clock, pull=True)

    clock.last_message = fake.now - 1
    pull_taking(20)()
    clock.sleep(3)
    pull_taking(0.04)()
    clock.last_message = fake.now - 1
    clock.sleep(3)
    pull_taking(20, found=7)()
    clock.sleep(3)
    assert fake.slept == [0.0, 0.1, 0.1]


def test_the_clock_restarts_after_a_message_pulled_or_a_reply_pushed(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(flower_waits, "time", fake)
    clock = flower_waits.PollClock(0.1)
    clock.last_message = 0.0
    pulled = flower_waits.NotingMessages(lambda run_id: run_id, clock, pull=True)
    assert pulled(None) is None and clock.last_message == 0.0  # nothing came
    assert pulled(7) == 7 and clock.last_message == fake.now
    clock.last_message = 0.0
    pushed = flower_waits.NotingMessages(lambda: None, clock, pull=False)
    pushed()
    assert clock.last_message == fake.now


def test_object_pulls_never_retry_later_than_flowers():
    """--poll-interval takes up to 3 s; the object pulls' first retry is
    that interval, but never later than Flower's own (1 s): at 3 s it was 3."""
    result = run_python(
        "from pollen import flower_waits\n"
        "from flwr.supercore import constant\n"
        "from flwr.supercore.inflatable import inflatable_utils as utils\n"
        "assert flower_waits.shorten_clientapp_pulls(3.0)\n"
        "first = utils.pull_and_inflate_object_from_tree.__kwdefaults__\n"
        "print(first['initial_backoff'], constant.PULL_INITIAL_BACKOFF)\n"
    )
    assert result.returncode == 0, result.stderr
    first, flowers = map(float, result.stdout.split())
    assert first == flowers == 1.0


REPLY_WAIT = """
import sys, threading
from flwr.common.constant import SubStatus
from flwr.supercore.constant import TaskType
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supernode import start_client_internal as node
from flwr.supernode.nodestate import NodeStateFactory
from pollen import flower_waits

if sys.argv[1] == "patched":
    flower_waits.end_reply_waits_without_task()
factory = NodeStateFactory(ObjectStoreFactory())
state, store = factory.state(), factory.objectstore_factory.store()
state.set_node_id(1)
task = state.create_task(task_type=TaskType.CLIENT_APP, run_id=7, fab_hash="f")
assert state.finish_task(task, sub_status=SubStatus.FAILED, details="no message")
returned = threading.Event()

def push():
    node._push_messages(state=state, object_store=store, send=None, push_object=None)
    returned.set()

threading.Thread(target=push, daemon=True).start()
ended = returned.wait(2)
state.create_task(task_type=TaskType.CLIENT_APP, run_id=7, fab_hash="f")
returned.clear()
threading.Thread(target=push, daemon=True).start()
print(ended, returned.wait(1))
"""


def test_a_supernode_stops_waiting_for_a_reply_no_task_will_write():
    """Flower 1.42's `_push_messages` waits for a reply without end: a task
    that ended without one (here: failed) left the SuperNode taking no
    message again. `pollen supernode` ends that wait, as Flower does from
    1.43; while a task is unfinished it still waits for its reply."""
    import flwr

    patched = run_python(REPLY_WAIT.replace("sys.argv[1]", "'patched'"))
    assert patched.returncode == 0, patched.stderr
    assert patched.stdout.split() == ["True", "False"]
    if flwr.__version__ == "1.42.0":  # Flower as it ships: the wait never ends
        plain = run_python(REPLY_WAIT.replace("sys.argv[1]", "'plain'"))
        assert plain.returncode == 0, plain.stderr
        assert plain.stdout.split() == ["False", "False"]


def test_both_supernode_patches_apply_in_the_order_pollen_supernode_applies_them():
    """Each wraps `_push_messages`: the second's guard reads the source
    through the first's wrapper (it once read a wrapper, and every node
    silently kept Flower's 3 s waits)."""
    import flwr

    from pollen.flower_patches import SUPERNODE_REPLY_WAIT

    result = run_python(
        "from pollen import flower_waits\n"
        "print(flower_waits.end_reply_waits_without_task(),"
        " flower_waits.shorten_supernode_waits(0.1))\n"
    )
    assert result.returncode == 0, result.stderr
    ended = str(not SUPERNODE_REPLY_WAIT.made_upstream(flwr.__version__))
    assert (result.stdout.split(), result.stderr) == ([ended, "True"], "")


def test_a_reply_stored_as_its_task_finishes_is_pushed():
    """A ClientApp stores its reply, then finishes its task: a first look
    that found no reply and then no unfinished task looks once more."""

    class Finished:
        """No task left; the replies each look finds, in turn."""

        def __init__(self, *looks: list[str]) -> None:
            self.looks = list(looks)

        def get_messages_legacy(self, **filters):
            return self.looks.pop(0)

        def get_tasks(self, **filters):
            return []

    racing = flower_waits.TaskAwareState(Finished([], ["reply"]))
    assert racing.get_messages_legacy(is_reply=True) == ["reply"]
    with pytest.raises(flower_waits.NothingToPush):  # none in either look
        flower_waits.TaskAwareState(Finished([], [])).get_messages_legacy(is_reply=True)
