"""The `pollen` command.

`pollen run [APP] [CONNECTION] [-c RUN_CONFIG]... [--federation-config CFG]...`
takes `flwr run`'s options. Without a CONNECTION it runs a simulation on a
SuperLink of its own: private Flower home, free port, no runtime dependency
installation, stopped (by PID) when the run ends. With a CONNECTION (from your
Flower config, e.g. a deployment) it submits there. Either way it streams the
log until the ServerApp reports its results written (not through Flower's
shutdown), reads the run's `summary.json`, prints where the results are, and
exits non-zero when the run failed (`flwr run` itself exits 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import compare, deploy
from .checkpoints import CheckpointError, check_resumable
from .deploy import entry_point, flower_env, free_port
from .fab import staged_app
from .notify import URL_ENV, check_url
from .results import (
    RUN_COMPLETED,
    ResultsError,
    check_run_dir_is_new,
    default_run_name,
    write_atomic,
)
from .settings import Settings, SettingsError

SUPERLINK_START_SECONDS = 60.0
EXIT_FAILED, EXIT_BAD_INPUT = 1, 2
CLIENT_CPUS = 1  # per ClientApp actor in a simulation, unless the user says
DEPLOY_DIR = Path(".pollen-deploy")
# Ray starts one idle Python worker per CPU for a simulation's first driver;
# Flower's ClientApp actors never run in them, so they only cost start-up CPU
# (1.2 s of 28 on 2 cores, docs/performance.md). A value the user sets wins.
RAY_SIMULATION_ENV = {"RAY_prestart_worker_first_driver": "0"}


class CliError(RuntimeError):
    """A problem the user must fix before anything runs."""


def resolve_run_config(app: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """pyproject defaults, then each `--run-config` value in order (later wins).

    Unlike `flwr run`, TOML files and "key=value" strings may be mixed.
    """
    from click import ClickException
    from flwr.common.config import get_project_config, parse_config_args

    try:
        config = dict(get_project_config(app)["tool"]["flwr"]["app"]["config"])
    except (FileNotFoundError, KeyError, ValueError) as err:
        raise CliError(
            f"{app} is not a Flower App with [tool.flwr.app.config]: {err}"
        ) from err
    for value in overrides:
        try:
            parsed = parse_config_args([value])
        except (ValueError, OSError, ClickException) as err:
            raise CliError(f"invalid --run-config {value!r}: {err}") from err
        unknown = sorted(set(parsed) - set(config))
        if unknown:
            raise CliError(
                f"unknown run-config key {unknown[0]!r} in {value!r}; known keys: "
                + ", ".join(config)
            )
        config.update(parsed)
    return config


def pin_paths(settings: Settings, strategy: str) -> Settings:
    """`data-root`, `output-dir` and `resume` made absolute against this
    shell's directory, and an empty `run-name` given a generated one (named
    after `strategy`), so this command knows where results land."""
    return dataclasses.replace(
        settings,
        data_root=str(Path(settings.data_root).expanduser().resolve()),
        output_dir=str(Path(settings.output_dir).expanduser().resolve()),
        run_name=settings.run_name or default_run_name(strategy, settings.data_set),
        resume=settings.resume and str(Path(settings.resume).expanduser().resolve()),
    )


def prepare_run(app: Path, overrides: Sequence[str]) -> tuple[Settings, str]:
    """Validate the run config and pin what the ServerApp must not guess.

    Relative `data-root`/`output-dir` are resolved against this shell's
    directory (the SuperLink's processes run elsewhere), and an empty
    `run-name` gets a generated one, so this command knows where results land
    (with `resume`: the directory being resumed). Returns the settings and the complete run config as one "key=value" string.
    """
    settings = Settings.from_run_config(resolve_run_config(app, overrides))
    settings = pin_paths(settings, settings.strategy)
    if not settings.notify_url and os.environ.get(URL_ENV):
        try:
            check_url(os.environ[URL_ENV], from_env=True)
        except ValueError as err:
            raise SettingsError(str(err)) from None
    if settings.resume:
        check_resumable(Path(settings.resume), settings.to_run_config())
    else:
        check_run_dir_is_new(settings.output_dir, settings.run_name)
    config = settings.to_run_config()
    return settings, " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())


class LocalSuperLink:
    """A simulation SuperLink owned by this command, in its own Flower home.

    It runs in that home, not in the shell's directory: Ray puts its driver's
    directory (the simulation process, started by the SuperLink) first on
    every ClientApp actor's module path, so a `pollen` package in the shell's
    directory (another checkout) would be imported there instead of the app's
    own. Paths in the run config are made absolute before the run starts.
    """

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="pollen-flwr-home-"))
        self.port = free_port()
        self.log_path = self.home / "superlink.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**RAY_SIMULATION_ENV, **flower_env(self.home)}

    def __enter__(self) -> LocalSuperLink:
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "pollen"\n\n'
            f'[superlink.pollen]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        command = [
            entry_point("flower-superlink"), "--insecure", "--simulation",
            "--isolation", "subprocess", "--host", "127.0.0.1", "--port", str(self.port),
            "--disable-runtime-dependency-installation",
            "--log-file", str(self.log_path),
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            env=self.env,
            cwd=self.home,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, stopped as one
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + SUPERLINK_START_SECONDS
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (
                    self.log_path.read_text()[-2000:] if self.log_path.exists() else ""
                )
                raise CliError(
                    f"flower-superlink exited with code {self.process.returncode}:\n{log}"
                )
            try:
                with urllib.request.urlopen(url, timeout=0.5) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise CliError(f"flower-superlink did not start in {SUPERLINK_START_SECONDS} s")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            deploy.stop(self.process.pid)
        shutil.rmtree(self.home, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    app = Path(args.app).expanduser().resolve()
    try:
        settings, run_config = prepare_run(app, args.run_config)
    except (SettingsError, CliError, ResultsError, CheckpointError) as err:
        print(f"pollen: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    deployment = None
    if args.deployment:
        try:
            deployment = _running_deployment(Path(args.deployment), args.connection)
        except deploy.DeployError as err:
            print(f"pollen: error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
    federation = list(args.federation_config)
    if args.connection is None and deployment is None:
        try:
            federation = simulation_federation(federation, settings.num_clients)
        except CliError as err:
            print(f"pollen: error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
    run_dir = Path(settings.resume or Path(settings.output_dir) / settings.run_name)
    with staged_app(app) as staged:
        _submit(args, staged, run_config, federation, run_dir, deployment)
    return report(run_dir)


def _submit(
    args: argparse.Namespace,
    app: Path,
    run_config: str,
    federation: list[str],
    run_dir: Path,
    deployment: deploy.Deployment | None,
) -> None:
    """`flwr run` the app: on a SuperLink of its own (simulation), on a
    `pollen deploy` deployment, or on the SuperLink named by a connection."""
    flwr_args = ["run", str(app), "--run-config", run_config]
    for value in federation:
        flwr_args += ["--federation-config", value]
    flwr_args.append("--stream")
    if deployment is not None:
        flwr_args.insert(2, deploy.CONNECTION)
        _flwr(flwr_args, flower_env(deployment.flwr_home))
    elif args.connection is None:
        with LocalSuperLink() as link:
            _flwr(flwr_args, link.env)
            _keep_log(link.log_path, run_dir)
    else:
        flwr_args.insert(2, args.connection)
        _flwr(flwr_args, dict(os.environ))


def simulation_federation(federation: list[str], num_clients: int) -> list[str]:
    """The `--federation-config` values of a simulation, with pollen's defaults
    for the keys the user did not set: one SuperNode per client, and one CPU
    per ClientApp actor. Flower's default of 2 CPUs runs one client at a time
    with two torch threads; with one CPU each, Ray runs as many actors as
    there are cores, each with one thread (Ray sets `OMP_NUM_THREADS` from
    the actor's CPUs), which on 2 cores trains the `mlp` workload's rounds
    1.8x faster (docs/performance.md)."""
    from click import ClickException
    from flwr.common.config import parse_config_args  # what `flwr run` reads

    try:
        given = parse_config_args(federation)
    except (ValueError, ClickException) as err:
        raise CliError(f"invalid --federation-config {federation}: {err}") from err
    defaults = {
        "num-supernodes": num_clients,
        "client-resources-num-cpus": CLIENT_CPUS,
    }
    return federation + [f"{k}={v}" for k, v in defaults.items() if k not in given]


def _running_deployment(directory: Path, connection: str | None) -> deploy.Deployment:
    if connection is not None:
        raise deploy.DeployError("give a CONNECTION or --deployment, not both")
    deployment = deploy.Deployment.load(directory.expanduser().resolve())
    if not deploy.alive(deployment.superlink_pid):
        raise deploy.DeployError(
            f"the deployment in {deployment.root} is not running; start it with "
            f"`pollen deploy up --dir {directory}`"
        )
    return deployment


def _flwr(flwr_args: list[str], env: dict[str, str]) -> None:
    """`flwr run`, its output passed through line by line, until it exits or,
    sooner, until the ServerApp says it completed: every result is written by
    then, and Flower's own shutdown of the simulation (stopping Ray, draining
    the log stream) would keep the command waiting about 4 s longer."""
    process = subprocess.Popen(
        [entry_point("flwr"), *flwr_args],
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    completed = RUN_COMPLETED.encode()
    try:
        for line in process.stdout:
            _pass_on(line)
            if completed in line:
                break
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _pass_on(line: bytes) -> None:
    """Write `line` to stdout as it came (as text where stdout takes no bytes),
    after anything printed before it."""
    sys.stdout.flush()
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:
        sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()
    else:
        buffer.write(line)
        buffer.flush()


def _keep_log(log_path: Path, run_dir: Path) -> None:
    if log_path.exists() and run_dir.is_dir():
        target, n = run_dir / "superlink.log", 1
        while target.exists():  # a resumed run keeps the earlier logs
            n += 1
            target = run_dir / f"superlink-{n}.log"
        shutil.copy(log_path, target)


def report(run_dir: Path) -> int:
    """Exit status from the run's own record of how it ended."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        print(
            f"pollen: run failed before writing {summary_path} (see the log above)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    summary = json.loads(summary_path.read_text())
    if summary.get("status") != "completed":
        print(f"pollen: run failed: {summary.get('error')}", file=sys.stderr)
        print(f"pollen: results (partial) in {run_dir}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"pollen: completed {summary['rounds']} rounds, final accuracy "
        f"{100 * summary['final-accuracy']:.2f}% (best {100 * summary['best-accuracy']:.2f}%"
        f" at round {summary['best-round']}), {summary['total-seconds']:.1f} s"
    )
    print(f"pollen: results in {run_dir}")
    return 0


def _public_keys(paths: Sequence[Path]) -> list[Path]:
    """The public key files named, directories expanded to their *.pub files."""
    keys = []
    for path in paths:
        if path.is_dir():
            keys += sorted(path.glob("*.pub"))
        elif path.is_file():
            keys.append(path)
        else:
            raise deploy.DeployError(f"no public key at {path}")
    return keys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pollen", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser(
        "run", help="run a simulation (or submit to CONNECTION) and wait for it"
    )
    run_parser.add_argument("app", nargs="?", default=".", help="Flower App folder")
    run_parser.add_argument(
        "connection", nargs="?", default=None,
        help="SuperLink connection in your Flower config (default: a private simulation)",
    )  # fmt: skip
    run_parser.add_argument(
        "-c", "--run-config", action="append", default=[],
        help='TOML file or "key=value ..." overrides (repeatable)',
    )  # fmt: skip
    run_parser.add_argument(
        "--federation-config", action="append", default=[],
        help='e.g. "num-supernodes=10" (simulation defaults: num-supernodes=num-clients, '
        "client-resources-num-cpus=1)",
    )  # fmt: skip
    run_parser.add_argument(
        "--deployment", metavar="DIR", default=None,
        help="submit to the deployment `pollen deploy up` started in DIR",
    )  # fmt: skip
    run_parser.set_defaults(handler=run)
    _add_deploy_parser(commands)
    commands.add_parser(
        "superexec", add_help=False,
        help="Flower's SuperExec with warm ClientApp processes (for a SuperNode "
        "started with --isolation process); `pollen superexec --help`",
    )  # fmt: skip
    _add_compare_parsers(commands)
    central = commands.add_parser(
        "centralized", help="the centralised baseline: the run's model and data, no federation",
        description="Reads the same run config as `pollen run` and trains its model "
        "on the whole training set with the client optimiser, testing after "
        "every epoch; writes a run directory that `pollen report` reads.",
    )  # fmt: skip
    central.add_argument("app", nargs="?", default=".", help="Flower App folder")
    central.add_argument(
        "-c", "--run-config", action="append", default=[],
        help='TOML file or "key=value ..." overrides (repeatable)',
    )  # fmt: skip
    central.add_argument(
        "--epochs", type=int, default=None, help="default: rounds x local-epochs"
    )
    central.set_defaults(handler=run_centralized)
    return parser


def run_centralized(args: argparse.Namespace) -> int:
    from . import centralized  # imports torch: only this command pays for it

    app = Path(args.app).expanduser().resolve()
    try:
        settings = Settings.from_run_config(resolve_run_config(app, args.run_config))
        if settings.resume:
            raise CliError("a centralised run cannot resume; leave out resume")
        if args.epochs is not None and args.epochs < 1:
            raise CliError(f"--epochs must be at least 1, got {args.epochs}")
        settings = pin_paths(settings, centralized.STRATEGY)
        check_run_dir_is_new(settings.output_dir, settings.run_name)
    except (SettingsError, CliError, ResultsError) as err:
        print(f"pollen: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    epochs = args.epochs or settings.rounds * settings.local_epochs
    run_dir, summary = centralized.train_centrally(settings, epochs)
    print(f"pollen: centralised {epochs} epochs: final accuracy "
          f"{100 * summary['final-accuracy']:.2f}%, {summary['total-seconds']:.1f} s")  # fmt: skip
    print(f"pollen: results in {run_dir}")
    return 0


def _add_compare_parsers(commands: argparse._SubParsersAction) -> None:
    grid = commands.add_parser(
        "compare", help="run a grid of simulations and compare them",
        description=compare.__doc__.split("\n\n")[1],
    )  # fmt: skip
    grid.add_argument("grid", type=Path, help="TOML file: [base], [grid], target")
    grid.add_argument("app", nargs="?", default=".", help="Flower App folder")
    grid.add_argument(
        "--out", type=Path, required=True, help="the comparison's directory"
    )
    grid.add_argument(
        "-c", "--run-config", action="append", default=[],
        help="TOML file or \"key=value ...\" applied to every cell (repeatable)",
    )  # fmt: skip
    grid.add_argument(
        "--only", action="append", default=[], metavar="KEY=VALUE",
        help="run only the cells with this grid value, as cell names spell it "
        "(repeatable; e.g. --only strategy=fedavg)",
    )  # fmt: skip
    grid.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and list the cells, run nothing",
    )
    grid.set_defaults(handler=run_comparison)
    again = commands.add_parser(
        "report", help="tables and plots from result directories, without training",
        description=compare.__doc__.split("\n\n")[2],
    )  # fmt: skip
    again.add_argument("directory", type=Path, help="a comparison, or a folder of runs")
    again.add_argument(
        "--target", type=float, default=None,
        help="accuracy in (0, 1] whose first round the table gives (default: the grid's)",
    )  # fmt: skip
    again.set_defaults(handler=report_comparison)


def run_comparison(args: argparse.Namespace) -> int:
    app = Path(args.app).expanduser().resolve()

    def validate(config: str) -> dict[str, Any]:
        try:
            return Settings.from_run_config(
                resolve_run_config(app, [*args.run_config, config])
            ).to_run_config()
        except (SettingsError, CliError) as err:
            raise compare.CompareError(f"cell {config!r}: {err}") from None

    try:
        grid = compare.Grid.load(args.grid).select(args.only)
        cells = compare.validate_cells(grid, validate)  # before any write
        if args.dry_run:
            print_plan(cells, args.out)
            return 0
        with compare.exclusive(args.out) as running:
            cells = compare.with_states(cells, args.out)
            write_atomic(args.out / "grid.toml", args.grid.read_text())
            run_cell = compare.pollen_run_cell(app, args.out, args.run_config)
            compare.run_grid(cells, args.out, run_cell, running=running)
            table = compare.report(args.out, grid.target)
    except compare.CompareError as err:
        print(f"pollen: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(table.read_text(), end="")
    print(f"pollen: comparison in {args.out}")
    return 0


def print_plan(cells: list[compare.Cell], out: Path) -> None:
    """`compare --dry-run`: each cell's state, and the cell another compare
    is running there now (its run directory looks interrupted)."""
    running = compare.running_now(out)
    if running is not None:
        print(f"pollen: another pollen compare (pid {running.pid}) is running in {out}")
    for cell in compare.with_states(cells, out):
        print(f"{cell.name}: {compare.describe(cell, running)}: {cell.config}")


def report_comparison(args: argparse.Namespace) -> int:
    try:
        target = args.target
        if target is None and (args.directory / "grid.toml").exists():
            target = compare.Grid.load(args.directory / "grid.toml").target
        if target is not None and not 0 < target <= 1:
            raise compare.CompareError(f"--target must be in (0, 1], got {target}")
        table = compare.report(args.directory, target)
    except compare.CompareError as err:
        print(f"pollen: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(table.read_text(), end="")
    return 0


def _add_deploy_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "deploy", help="a deployment of real Flower processes on this machine",
        description=deploy.__doc__.split("\n\n")[0],
    )  # fmt: skip
    actions = parser.add_subparsers(dest="action", required=True)
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--dir", default=DEPLOY_DIR, type=Path,
        help=f"the deployment's directory (default {DEPLOY_DIR})",
    )  # fmt: skip
    up = actions.add_parser(
        "up", parents=[where], help="start a SuperLink and N SuperNodes"
    )
    up.add_argument("--nodes", type=int, default=3, help="SuperNodes (default 3)")
    up.add_argument("--host", default="127.0.0.1",
                    help="address the SuperLink listens on (default 127.0.0.1)")  # fmt: skip
    up.add_argument(
        "--port", type=int, default=9093, help="SuperLink port (default 9093)"
    )
    up.add_argument(
        "--san", action="append", default=[],
        help="another host name or IP address SuperNodes use to reach the SuperLink "
        "(repeatable; added to its certificate)",
    )  # fmt: skip
    up.add_argument("--data-root", default="", help="every node's data-root")
    up.add_argument(
        "--node-config", action="append", default=[], metavar="K:KEY=VALUE",
        help='extra node config for node K, e.g. 0:data-file="/silo/own.npz" (repeatable)',
    )  # fmt: skip
    up.add_argument(
        "--insecure", action="store_true",
        help="no TLS and no SuperNode authentication (trusted networks only)",
    )  # fmt: skip
    up.add_argument(
        "--executor", choices=deploy.EXECUTORS, default="warm",
        help="ClientApp processes: warm (`pollen superexec`, forked from a "
        "preloaded parent; default) or cold (Flower's, one per message)",
    )  # fmt: skip
    actions.add_parser("down", parents=[where], help="stop what `up` started")
    actions.add_parser("status", parents=[where], help="processes and online nodes")
    restart = actions.add_parser(
        "restart", parents=[where],
        help="restart one SuperNode (same key and config) or the SuperLink "
        "(same database and certificates)",
    )  # fmt: skip
    restart.add_argument(
        "target", metavar="K|superlink",
        help="a node's partition-id, or `superlink`",
    )  # fmt: skip
    certs = actions.add_parser(
        "certs", help="make a CA and a SuperLink certificate (multi-machine)"
    )
    certs.add_argument("out", type=Path, help="directory for ca.pem, server.pem/.key")
    certs.add_argument("hosts", nargs="+", help="the SuperLink's host names / IPs")
    certs.add_argument(
        "--force", action="store_true", help="replace certificates already in OUT"
    )
    key = actions.add_parser("key", help="make a SuperNode key pair (multi-machine)")
    key.add_argument("path", type=Path, help="private key path (PATH.pub: public)")
    register = actions.add_parser(
        "register", help="register SuperNode public keys with a SuperLink"
    )
    register.add_argument(
        "keys", nargs="+", type=Path,
        help="public key files, or directories whose *.pub files are registered",
    )  # fmt: skip
    register.add_argument(
        "--connection",
        required=True,
        help="the SuperLink's connection in the Flower config",
    )
    parser.set_defaults(handler=deploy_command)


def deploy_command(args: argparse.Namespace) -> int:
    try:
        if args.action == "up":
            extra = _node_extra(args.node_config, args.nodes)
            if args.insecure:
                print("pollen: warning: insecure deployment: no TLS, any SuperNode "
                      "may join; use it on a trusted network only", file=sys.stderr)  # fmt: skip
            deploy.up(
                args.dir, args.nodes, host=args.host, port=args.port, san=args.san,
                insecure=args.insecure, data_root=args.data_root, node_extra=extra,
                executor=args.executor,
            )  # fmt: skip
            print(deploy.status(args.dir))
        elif args.action == "down":
            stopped = deploy.down(args.dir)
            print(f"pollen: stopped {len(stopped)} processes; files kept in {args.dir}")
        elif args.action == "status":
            print(deploy.status(args.dir))
        elif args.action == "restart" and args.target == "superlink":
            pid = deploy.restart_superlink(args.dir)
            print(f"pollen: SuperLink restarted (pid {pid}); the SuperNodes "
                  "reconnect by themselves; resume an interrupted run with "
                  "resume='<its run directory>'")  # fmt: skip
        elif args.action == "restart":
            if not args.target.isdigit():
                raise deploy.DeployError(
                    f"restart {args.target!r}: expected `superlink` or a node's "
                    "partition-id (0, 1, ...)"
                )
            node = deploy.restart_node(args.dir, int(args.target))
            print(f"pollen: node {node.partition_id} restarted (pid {node.pid})")
        elif args.action == "certs":
            existing = [
                p.name for p in deploy.certificate_files(args.out) if p.exists()
            ]
            if existing and not args.force:
                raise deploy.DeployError(
                    f"{args.out} already has {', '.join(existing)}; nodes may trust "
                    "them: keep them, or replace them with --force"
                )
            deploy.make_certificates(args.out, args.hosts)
            print(f"pollen: CA and SuperLink certificate for {', '.join(args.hosts)} "
                  f"in {args.out}")  # fmt: skip
        elif args.action == "register":
            for public in _public_keys(args.keys):
                new = deploy.register_key(public, args.connection, dict(os.environ))
                print(
                    f"pollen: {public.stem} "
                    + ("registered" if new else "was registered")
                )
        else:
            public = deploy.make_node_key(args.path)
            print(f"pollen: SuperNode key {args.path}; register {public} with "
                  "`flwr supernode register`")  # fmt: skip
    except deploy.DeployError as err:
        print(f"pollen: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _node_extra(values: Sequence[str], num_nodes: int) -> dict[int, dict[str, str]]:
    """`K:key=value` flags -> {K: {key: value}} (values parsed as TOML)."""
    from click import ClickException
    from flwr.common.config import parse_config_args

    extra: dict[int, dict[str, str]] = {}
    for value in values:
        node, sep, pairs = value.partition(":")
        if not (sep and node.isdigit() and int(node) < num_nodes):
            raise deploy.DeployError(
                f"--node-config {value!r}: expected K:key=value with K a node "
                f"index 0..{num_nodes - 1}"
            )
        try:
            extra.setdefault(int(node), {}).update(parse_config_args([pairs]))
        except (ValueError, ClickException) as err:
            raise deploy.DeployError(f"--node-config {value!r}: {err}") from None
    return extra


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "superexec":  # every other flag is flower-superexec's
        from .deployment import superexec

        return superexec.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
