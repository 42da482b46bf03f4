"""The three-machine deployment tutorial runs as its page writes it.

docs/tutorials/three-machines.md's shell commands, read from the page itself,
run on this one machine: each of its machines (the server, `silo-a`,
`silo-b`) is a folder of the test's own, that machine's home, and each
shell keeps its folder and environment from one command block to the next,
as a reader's shell does. What the page says the reader sees is what the
commands print, and the run it submits trains to the accuracy it shows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pollen.deployment import processes
from pollen.deployment.fab import fab_files
from tests.conftest import PROJECT, fenced_blocks

pytestmark = pytest.mark.integration
PAGE = PROJECT / "docs" / "tutorials" / "three-machines.md"
BIN = Path(sys.executable).parent
COMMAND_SECONDS = 120  # one foreground command (the run: RUN_SECONDS)
RUN_SECONDS = 400  # `pollen run`'s 3 rounds: about 50 s on 2 cores
START_SECONDS = 60  # the SuperLink up, both SuperNodes online
# Where each of the page's bash blocks runs, in the page's order (the test
# takes them by position): the server's first shell (certificates, Flower
# config, registration, listing, the run), its second (the SuperLink), each
# silo's. None: step 1's set-up, not run.
MACHINES = [None, "server", "superlink", "server", "silo", "server", "silo",
            "server", "server"]  # fmt: skip


class Shell:
    """A shell on one of the tutorial's machines: its folder and its
    environment carry over from one command block to the next (`cd`,
    `export`), as in a terminal."""

    def __init__(self, home: Path, edit: Callable[[str], str], log: Path) -> None:
        self.edit, self.log, self.cwd = edit, log, home
        self.env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("FLWR_", "VIRTUAL_ENV"))
        }
        self.env.update({
            "HOME": str(home),
            # `source .venv/bin/activate`: pollen, flwr and Flower's commands
            "PATH": os.pathsep.join([str(BIN), os.environ["PATH"]]),
            "VIRTUAL_ENV": str(BIN.parent),
            "FLWR_TELEMETRY_ENABLED": "0",  # test traffic stays on this machine
            "FLWR_DISABLE_UPDATE_CHECK": "1",
        })  # fmt: skip

    def run(self, block: str, timeout: float = COMMAND_SECONDS) -> str:
        """Run `block` (edited for this machine) to its end; its output. One
        that outlasts `timeout` is stopped, with what it started."""
        state = self.log.with_suffix(".state")
        script = (
            f"set -e\n{self.edit(block)}\npwd > {state}.cwd\nenv -0 > {state}.env\n"
        )
        shell = subprocess.Popen(
            ["bash", "-c", script], cwd=self.cwd, env=self.env, text=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            output, _ = shell.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            processes.stop(shell.pid, grace=2)
            shell.communicate()
            raise
        with self.log.open("a") as log:
            log.write(f"$ {self.edit(block)}\n{output}\n")
        assert shell.returncode == 0, f"{self.edit(block)}\n{output[-4000:]}"
        self.cwd = Path(Path(f"{state}.cwd").read_text().strip())
        pairs = Path(f"{state}.env").read_text().split("\0")
        self.env = dict(p.split("=", 1) for p in pairs if "=" in p)
        return output

    def start(self, block: str, log: Path) -> int:
        """Start `block` (edited for this machine) in the background, as a
        process group of its own with its output in `log`; its PID."""
        command = ["bash", "-c", self.edit(block)]
        return processes.start(command, log=log, env=self.env, cwd=self.cwd).pid


ANSI = re.compile(r"\x1b\[[0-9;]*m")
RULE = re.compile(r"([━─═])\1*")  # a run of one of a table's rule characters


def missing(shown: str, output: str) -> str | None:
    """The first line of a page's output block (`shown`) that `output` does
    not show, in the page's order; None when it shows them all. A page's
    `...` stands for anything (a lone `...`: any lines), its numbers for
    any numbers (times, IDs, PIDs, the ports, "yours will differ a little"),
    its spaces for any spaces (a table's columns as wide as their cells)."""
    lines = [ANSI.sub("", line).strip() for line in output.splitlines()]
    at = 0
    for want in shown.strip().splitlines():
        if want.strip() == "...":
            continue
        line = re.compile(" +".join(map(word_pattern, want.split())))
        while at < len(lines) and not line.fullmatch(lines[at]):
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


def word_pattern(word: str) -> str:
    """A pattern for one word of a page's output: `...` any text, a number any,
    a run of a table's rule (`━━━`) a run of any length (columns are as wide
    as their cells: a node ID may have 19 digits or 20)."""
    parts = [re.sub(r"\d+", r"\\d+", re.escape(part)) for part in word.split("...")]
    return ".*".join(RULE.sub(r"\1+", part) for part in parts)


def wait_for(pid: int, log: Path, shown: str, name: str) -> None:
    """Wait until the log of process `pid` shows what the page does."""
    processes.wait_ready(
        pid, lambda: missing(shown, log.read_text(errors="replace")) is None,
        name=name, log=log, timeout=START_SECONDS,
    )  # fmt: skip


def test_the_three_machine_tutorial_runs_as_its_page_says(tmp_path: Path) -> None:
    """Every bash block of the page but step 1's set-up (this test's Python
    environment is what it makes), run through `bash -c` with these
    substitutions only:

    - each machine's home (`~`, `$HOME`: where `~/pollen-server`,
      `~/pollen-node` and the checkout `~/pollen` lie) is a folder of its
      own under a short temporary folder, removed after; the server's
      `~/pollen` holds a copy of the checkout's app files (what a clone
      holds that a run reads);
    - "environment activated" is this Python's bin folder first on PATH,
      so `pollen`, `flwr` and `flower-superlink` are this environment's;
    - `server.example.org` and 10.0.0.5 become `localhost` and 127.0.0.1
      (the names the certificate step gets), and ports 9093 (SuperLink)
      and 9094 (each silo's loopback) become free ones, different for the
      two silos, which share this machine;
    - `silo-b` runs `silo-a`'s commands with `node-1` and `partition-id=1`,
      as the page says;
    - the files step 4 says to exchange are copied between the folders;
    - in what the page shows, `/home/you` is the server's home.

    A shell the page gives no FLWR_HOME (the SuperLink's, the silos') has
    its machine's default, `~/.flwr`.

    The SuperLink and each silo's SuperNode and SuperExec are processes
    this test starts and always stops by PID. Flower posts no telemetry
    and checks for no update (nothing leaves this machine)."""
    page = PAGE.read_text()
    commands, shown = fenced_blocks(page, "bash"), fenced_blocks(page, "text")
    assert len(commands) == len(MACHINES), "the page's bash blocks changed"
    assert len(shown) == 7, "the page's output blocks changed"
    assert "make run" in commands[0] and "source .venv/bin/activate" in commands[0]
    ports = dict(zip(("9093", "a", "b"), processes.distinct_free_ports(3), strict=True))
    # Flower's and the warm executor's paths stay short (tmp_path may not be)
    root = Path(tempfile.mkdtemp(prefix="pollen-3m-"))
    homes = {name: root / name for name in ("server", "silo-a", "silo-b")}
    for home in homes.values():
        home.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()

    def edit(silo: str = "") -> Callable[[str], str]:
        def edited(text: str) -> str:
            text = text.replace("server.example.org", "localhost")
            text = text.replace("10.0.0.5", "127.0.0.1")
            text = text.replace("/home/you", str(homes["server"]))
            text = re.sub(r"\b9093\b", str(ports["9093"]), text)
            if silo:
                text = re.sub(r"\b9094\b", str(ports[silo]), text)
            if silo == "b":
                text = text.replace("node-0", "node-1")
                text = text.replace("partition-id=0", "partition-id=1")
            return text

        return edited

    server = Shell(homes["server"], edit(), logs / "server-shell.log")
    silos = {
        s: Shell(homes[f"silo-{s}"], edit(s), logs / f"silo-{s}-shell.log")
        for s in "ab"
    }
    started: list[int] = []
    began = time.monotonic()
    try:
        stage_checkout(homes["server"] / "pollen")
        # 2. the certificates
        output = server.run(commands[1])
        assert output.strip() == server.edit(shown[0]).strip(), output
        # 3. the SuperLink, in a second shell of the server's, in ~/pollen-server
        superlink = Shell(homes["server"], edit(), logs / "superlink-shell.log")
        superlink.cwd = homes["server"] / "pollen-server"
        superlink_log = logs / "superlink.log"
        started.append(superlink.start(commands[2], superlink_log))
        wait_for(started[-1], superlink_log, edit()(shown[1]), "flower-superlink")
        server.run(commands[3])
        # 4. a key on each silo; the public keys to the server, its CA to the silos
        for silo in silos.values():
            assert silo.run(commands[4]).strip() == silo.edit(shown[2]).strip()
        keys = homes["server"] / "pollen-server" / "keys"
        keys.mkdir()
        for s, name in (("a", "node-0"), ("b", "node-1")):
            node = homes[f"silo-{s}"] / "pollen-node"
            shutil.copy(node / f"{name}.pub", keys)
            shutil.copy(homes["server"] / "pollen-server" / "certs" / "ca.pem", node)
        # 5. the keys registered; again, harmlessly
        output = server.run(commands[5])
        assert output.strip() == shown[3].strip(), output
        again = re.search(r"it prints `(pollen: node-0 was registered)`", page)
        assert again and again[1] in server.run(commands[5])
        # 6. each silo's SuperNode and SuperExec; both listed online
        for s, silo in silos.items():
            log = logs / f"silo-{s}.log"
            started.append(silo.start(commands[6], log))
            wait_for(started[-1], log, shown[4], f"silo-{s}'s SuperNode")
        listed = wait_for_nodes(server, commands[7], started)
        assert missing(server.edit(shown[5]), listed) is None, listed
        # 7. the run, on both silos
        output = server.run(commands[8], timeout=RUN_SECONDS)
        seconds = time.monotonic() - began
        assert missing(server.edit(shown[6]), output) is None, output[-4000:]
        (summary,) = (homes["server"] / "pollen" / "results").glob("*/summary.json")
        result = json.loads(summary.read_text())
        tasks = [(logs / f"silo-{s}.log").read_text() for s in silos]
    finally:
        for pid in reversed(started):  # 8. stop: the silos, then the SuperLink
            processes.stop(pid)
        shutil.rmtree(root, ignore_errors=True)
    for line in ("pollen: 2 clients on 2 nodes", "pollen: completed 3 rounds,"):
        assert line in shown[6] and line in output, output[-4000:]
    assert result["status"] == "completed" and result["rounds"] == 3, result
    assert result["final-accuracy"] >= 0.9, result
    task = re.search(r"e\.g\. `(pollen superexec: task .*?)`", page, re.S)
    assert task, "the page shows no silo's task line"
    for log in tasks:  # each silo's SuperExec ran the run's tasks
        assert missing(" ".join(task[1].split()), log) is None, log[-3000:]
    print(f"the tutorial's commands ran in {seconds:.0f} s")


def stage_checkout(folder: Path) -> None:
    """A copy of the checkout's app files at `folder`: the server's `~/pollen`."""
    for relative in fab_files(PROJECT):
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PROJECT / relative, folder / relative)


def wait_for_nodes(server: Shell, command: str, started: list[int]) -> str:
    """`command` (`flwr supernode list`) run until it lists two nodes online
    (each silo polls its SuperLink every few seconds); its output."""
    deadline = time.monotonic() + START_SECONDS
    while True:
        output = server.run(command)
        if sum(" online " in line for line in output.splitlines()) == 2:
            return output
        assert all(processes.alive(pid) for pid in started), output
        assert time.monotonic() < deadline, output
        time.sleep(1)
