"""The `pollen` command.

Argument parsing, and one map from errors to exit codes; each command's
work is done elsewhere: `pollen run`, `pollen compare` and `pollen report`
by `pollen.api` (the same functions a Python user calls: `pollen.run`,
`pollen.compare`, `pollen.report`; the run itself: `pollen.deployment.launch`),
`pollen deploy` by `pollen.deployment.deploy_actions` (the processes:
`pollen.deployment.cluster`), `pollen superexec` by
`pollen.deployment.superexec`, `pollen supernode` by
`pollen.deployment.supernode`, the grids by `pollen.experiments.compare`
(tables and plots: `pollen.experiments.report`),
`pollen centralized` by `pollen.experiments.centralized`, `pollen audit` by
`pollen.audit.run`, `pollen list` and
`pollen config` by `pollen.listing`. An expected error
is printed as one line and ends the command with the exit status
`EXIT_CODES` gives its kind: `EXIT_BAD_INPUT` for input to fix before
anything runs, `EXIT_FAILED` for a deployment or a process that failed (and
for a run that did not complete); an interrupted `pollen compare` (Ctrl-C,
or SIGTERM while a cell is deployed) or `pollen deploy up` says so in one
line and ends with `EXIT_INTERRUPTED`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import api, listing
from .audit import AuditError, AuditFailed
from .deployment import cluster, deploy_actions, superlink, supernode, warm_simulation
from .deployment.flower import without_telemetry
from .deployment.long_poll import add_pull_hold
from .deployment.network import NetworkError
from .deployment.processes import ProcessError
from .experiments import compare, report
from .flower_waits import add_poll_interval

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2
EXIT_INTERRUPTED = 130  # as a shell reports a command Ctrl-C stopped
DEPLOY_DIR = Path(".pollen-deploy")
RUN_CONFIG_HELP = (
    'TOML file, a preset\'s name (configs/NAME.toml) or "key=value ..." overrides '
    "(repeatable)"
)
EXIT_CODES = (
    ((*api.BAD_INPUT, cluster.DeployRefused, AuditError), EXIT_BAD_INPUT),
    ((cluster.DeployError, ProcessError, NetworkError,
      warm_simulation.WarmSimulationError, AuditFailed), EXIT_FAILED),
)  # fmt: skip
EXPECTED_ERRORS = tuple(kind for kinds, _ in EXIT_CODES for kind in kinds)


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` (argparse says what
    is wrong in one line and exits 2 before anything starts)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value

    return parse


def exit_code(error: Exception) -> int:
    """The exit status of a command that stopped with `error`."""
    return next(code for kinds, code in EXIT_CODES if isinstance(error, kinds))


def run_command(args: argparse.Namespace) -> int:
    try:
        api.run(
            args.run_config, app=args.app, connection=args.connection,
            federation=args.federation_config, deployment=args.deployment,
            warm=args.warm_simulation, network=args.network, verbose=args.verbose,
        )  # fmt: skip
    except KeyboardInterrupt:  # said by the run: where it stopped, how to resume
        return EXIT_INTERRUPTED
    except api.RunFailed:  # said by the run: its error, where its results are
        return EXIT_FAILED
    return 0


def centralized_command(args: argparse.Namespace) -> None:
    from .experiments import centralized  # imports torch: only this command pays

    app = Path(args.app).expanduser().resolve()
    centralized.run_centralized(app, args.run_config, args.epochs)


def audit_command(args: argparse.Namespace) -> None:
    from .audit import run  # imports torch: only this command pays

    request = run.AuditRequest(
        attack=args.attack, client=args.client, examples=args.examples,
        iterations=args.iterations, restarts=args.restarts, seed=args.seed,
        start=args.start, out=args.out,
    )  # fmt: skip
    run.run_audit(Path(args.app).expanduser().resolve(), args.run_config, request)


def compare_command(args: argparse.Namespace) -> int:
    try:
        api.compare(
            args.grid, args.run_config, out=args.out, app=args.app, only=args.only,
            network=args.network, simulate=args.simulate, jobs=args.jobs,
            dry_run=args.dry_run,
        )  # fmt: skip
    except KeyboardInterrupt:  # said by the comparison: how to resume it
        return EXIT_INTERRUPTED
    except api.RunFailed:  # said by the comparison: which cells, their logs
        return EXIT_FAILED
    return 0


def warm_command(args: argparse.Namespace) -> None:
    if args.action == "up":
        print(warm_simulation.warm_up(args.dir, args.cpus))
    elif args.action == "down":
        print(warm_simulation.warm_down(args.dir))
    else:
        federation = warm_simulation.WarmSimulation.load(args.dir.resolve())
        print(f"pollen: warm simulation in {args.dir}: "
              f"{warm_simulation.describe(federation)}")  # fmt: skip


def report_command(args: argparse.Namespace) -> None:
    print(api.report(args.directory, args.target).table(), end="")


def deploy_command(args: argparse.Namespace) -> int | None:
    if args.action == "up":
        if not deploy_actions.up(
            args.dir, args.nodes, host=args.host, port=args.port, san=args.san,
            insecure=args.insecure, data_root=args.data_root,
            node_config=args.node_config, executor=args.executor,
            node_poll=args.poll_interval, superlink_state=args.superlink_state,
            pull_hold=args.pull_hold,
        ):  # fmt: skip
            return EXIT_INTERRUPTED
    elif args.action == "down":
        deploy_actions.down(args.dir)
    elif args.action == "status":
        deploy_actions.status(args.dir)
    elif args.action == "restart":
        deploy_actions.restart(args.dir, args.target)
    elif args.action == "certs":
        deploy_actions.certs(args.out, args.hosts, args.force)
    elif args.action == "register":
        deploy_actions.register(args.keys, args.connection)
    else:
        deploy_actions.key(args.path)


def build_parser() -> argparse.ArgumentParser:
    """The `pollen` command's parser: one subcommand each, in the order
    `pollen --help` lists them, each with its handler as a default."""
    parser = argparse.ArgumentParser(prog="pollen", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(commands)
    _add_deploy_parser(commands)
    _add_flower_wrappers(commands)
    _add_warm_parser(commands)
    _add_compare_parsers(commands)
    _add_listing_parsers(commands)
    _add_centralized_parser(commands)
    _add_audit_parser(commands)
    return parser


def _add_app(parser: argparse.ArgumentParser) -> None:
    """The optional Flower App folder (default: here) of a command that reads
    the app's run config."""
    parser.add_argument("app", nargs="?", default=".", help="Flower App folder")


def _add_run_config(
    parser: argparse.ArgumentParser, text: str = RUN_CONFIG_HELP
) -> None:
    """The repeatable `-c/--run-config` (`text`: its help), its values kept in
    the order given."""
    parser.add_argument("-c", "--run-config", action="append", default=[], help=text)


def _add_run_parser(commands: argparse._SubParsersAction) -> None:
    """`pollen run`: where to run (a private simulation, a connection, a
    deployment or a warm federation) and what to simulate the network as."""
    parser = commands.add_parser(
        "run", help="run a simulation (or submit to CONNECTION) and wait for it"
    )
    _add_app(parser)
    parser.add_argument(
        "connection", nargs="?", default=None,
        help="SuperLink connection in your Flower config (default: a private simulation)",
    )  # fmt: skip
    _add_run_config(parser)
    parser.add_argument(
        "--federation-config", action="append", default=[],
        help='e.g. "num-supernodes=10" (simulation defaults: num-supernodes=num-clients '
        "up to 100, client-resources-num-cpus=1)",
    )  # fmt: skip
    parser.add_argument(
        "--deployment", metavar="DIR", default=None,
        help="submit to the deployment `pollen deploy up` started in DIR",
    )  # fmt: skip
    parser.add_argument(
        "--warm-simulation", metavar="DIR", default=None,
        help="simulate on the warm SuperLink and Ray head recorded in DIR (as "
        "`pollen compare` does for its cells) instead of starting both for this run",
    )  # fmt: skip
    parser.add_argument(
        "--network", metavar="PROFILE", default=None,
        help="network profile (a TOML file, or a preset in configs/networks/: "
        "datacenter, home-broadband, mobile-4g, mixed) for the simulated clock, "
        "recorded as sim-seconds; with --deployment the clock only predicts: a "
        "deployment's links are its own (`pollen compare --network` shapes them)",
    )  # fmt: skip
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="show Flower's and Ray's lines too (always in the run's flower.log)",
    )  # fmt: skip
    parser.set_defaults(handler=run_command)


def _add_flower_wrappers(commands: argparse._SubParsersAction) -> None:
    """`pollen superexec`, `pollen supernode` and `pollen superlink`: Flower's
    own commands, so their flags are left to them (`main` passes on what it
    does not parse)."""
    commands.add_parser(
        "superexec", add_help=False,
        help="Flower's SuperExec with warm ClientApp processes (for a SuperNode "
        "started with --isolation process); `pollen superexec --help`",
    )  # fmt: skip
    commands.add_parser(
        "supernode", add_help=False,
        help="Flower's SuperNode with its idle waits at a 0.1 s poll interval; "
        "`pollen supernode --help`",
    )  # fmt: skip
    commands.add_parser(
        "superlink", add_help=False,
        help="Flower's SuperLink, holding a node's pull until a message for it "
        "exists (up to 20 s); `pollen superlink --help`",
    )  # fmt: skip


def _add_listing_parsers(commands: argparse._SubParsersAction) -> None:
    """`pollen list` and `pollen config`: what pollen offers, and one key."""
    listing_parser = commands.add_parser(
        "list", help="what pollen offers: strategies, parts, models, data sets, keys"
    )
    listing_parser.add_argument(
        "section", nargs="?", choices=list(listing.SECTIONS),
        help="one section (default: all but keys)",
    )  # fmt: skip
    listing_parser.set_defaults(handler=lambda a: print(listing.listing(a.section)))
    config_parser = commands.add_parser(
        "config", help="one run-config key: its type, default, allowed values"
    )
    config_parser.add_argument("key")
    config_parser.set_defaults(handler=lambda a: print(listing.describe_key(a.key)))


def _add_centralized_parser(commands: argparse._SubParsersAction) -> None:
    """`pollen centralized`: the baseline without federation, read from the
    same run config as `pollen run`."""
    central = commands.add_parser(
        "centralized", help="the centralised baseline: the run's model and data, no federation",
        description="Reads the same run config as `pollen run` and trains its model "
        "on the whole training set with the client optimiser, testing after "
        "every epoch; writes a run directory that `pollen report` reads.",
    )  # fmt: skip
    _add_app(central)
    _add_run_config(central)
    central.add_argument(
        "--epochs", type=int, default=None, help="default: rounds x local-epochs"
    )
    central.set_defaults(handler=centralized_command)


def _add_audit_parser(commands: argparse._SubParsersAction) -> None:
    """`pollen audit`: a curious server's reconstruction of a client's examples."""
    audit = commands.add_parser(
        "audit", help="what a curious server rebuilds of a client's examples "
        "from what it receives (gradient inversion)",
        description="Plays the server for one round of the run config: sends "
        "the round's model to one client (training on its first --examples "
        "examples), takes exactly what the server receives (shared entries, "
        "clipped or noised as configured; under SecAgg+ the round's sum) and "
        "attacks it; writes audit.json (PSNR and SSIM per image) and audit.png.",
    )  # fmt: skip
    _add_app(audit)
    _add_run_config(audit)
    audit.add_argument("--attack", choices=("ig", "dlg", "idlg"), default="ig",
                       help="Inverting Gradients (default), DLG or iDLG")  # fmt: skip
    audit.add_argument("--client", type=_int_in(0, 10**9), default=None,
                       help="the client (default: the round's first sampled)")  # fmt: skip
    audit.add_argument("--examples", type=_int_in(1, 64), default=1,
                       help="the client trains on its first N examples (default 1)")  # fmt: skip
    audit.add_argument("--iterations", type=_int_in(1, 10**6), default=None,
                       help="optimiser iterations (default: 300 L-BFGS, 2000 for ig)")  # fmt: skip
    audit.add_argument("--restarts", type=_int_in(1, 100), default=1,
                       help="random restarts; the best is kept")  # fmt: skip
    audit.add_argument("--seed", type=int, default=0, help="the dummy data's seed")
    audit.add_argument("--from", dest="start", type=Path, default=None,
                       metavar="RUN_DIR", help="audit the round after this run's "
                       "newest checkpoint, with its settings (-c on top)")  # fmt: skip
    audit.add_argument("--out", type=Path, default=None,
                       help="output folder (default: under output-dir)")  # fmt: skip
    audit.set_defaults(handler=audit_command)


def _add_compare_parsers(commands: argparse._SubParsersAction) -> None:
    grid = commands.add_parser(
        "compare", help="run a grid of simulations (or deployments over a "
        "shaped network) and compare them",
        description=compare.__doc__.split("\n\n")[1],
    )  # fmt: skip
    grid.add_argument("grid", type=Path, help="TOML file: [base], [grid], target")
    _add_app(grid)
    grid.add_argument(
        "--out", type=Path, required=True, help="the comparison's directory"
    )
    _add_run_config(
        grid, 'TOML file or "key=value ..." applied to every cell (repeatable)'
    )
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
    grid.add_argument(
        "--jobs", type=int, default=1, metavar="N",
        help="run up to N simulated cells at once, each on a warm federation of "
        "its own, sharing this machine's CPUs (at most one per CPU; not with "
        "--network; histories as one after another); with RAY_ADDRESS set, on "
        "that Ray cluster, each with 1/N of its actors (at most one per CPU of it)",
    )  # fmt: skip
    grid.add_argument(
        "--network", metavar="PROFILE", default=None,
        help="run every cell as a deployment on this machine (TLS, node "
        "authentication, warm executor), each SuperNode in its own network "
        "namespace behind the link PROFILE gives it (a TOML file, or a preset "
        "in configs/networks/, e.g. mixed); needs root; records network.json "
        "per cell",
    )  # fmt: skip
    grid.add_argument(
        "--simulate", action="store_true",
        help="with --network: run the cells as simulations whose simulated "
        "clock the profile drives, instead of deployments",
    )  # fmt: skip
    grid.set_defaults(handler=compare_command)
    again = commands.add_parser(
        "report", help="tables and plots from result directories, without training",
        description=report.__doc__.split("\n\n")[1],
    )  # fmt: skip
    again.add_argument("directory", type=Path, help="a comparison, or a folder of runs")
    again.add_argument(
        "--target", type=float, default=None,
        help="accuracy in (0, 1] whose first round the table gives (default: the grid's)",
    )  # fmt: skip
    again.set_defaults(handler=report_command)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: allowed: an integer >= 1")
    return value


def _add_warm_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "warm", help="a simulation federation kept warm for the runs started "
        "in this folder (each skips the SuperLink's and Ray's start-up)",
        description=warm_simulation.__doc__.split("\n\n")[0],
    )  # fmt: skip
    actions = parser.add_subparsers(dest="action", required=True)
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--dir", default=warm_simulation.DEFAULT_DIR, type=Path,
        help=f"the federation's directory (default {warm_simulation.DEFAULT_DIR}, "
        "where `pollen run` looks for one)",
    )  # fmt: skip
    up = actions.add_parser(
        "up", parents=[where], help="start a SuperLink and a Ray head that stay"
    )
    up.add_argument(
        "--cpus", type=_at_least_one, default=None,
        help="CPUs the Ray head offers (default: all): one ClientApp actor each",
    )  # fmt: skip
    actions.add_parser("down", parents=[where], help="stop them")
    actions.add_parser("status", parents=[where], help="whether they run")
    parser.set_defaults(handler=warm_command)


def _add_deploy_parser(commands: argparse._SubParsersAction) -> None:
    """`pollen deploy`: the actions on a deployment in `--dir` (up, down,
    status, restart), and the files of one across machines."""
    parser = commands.add_parser(
        "deploy", help="a deployment of real Flower processes on this machine",
        description=cluster.__doc__.split("\n\n")[0],
    )  # fmt: skip
    actions = parser.add_subparsers(dest="action", required=True)
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--dir", default=DEPLOY_DIR, type=Path,
        help=f"the deployment's directory (default {DEPLOY_DIR})",
    )  # fmt: skip
    _add_deploy_up(actions, where)
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
    _add_multi_machine_actions(actions)
    parser.set_defaults(handler=deploy_command)


def _add_deploy_up(
    actions: argparse._SubParsersAction, where: argparse.ArgumentParser
) -> None:
    """`pollen deploy up`: how many SuperNodes, where the SuperLink listens,
    its security, the nodes' config and how their ClientApps run."""
    up = actions.add_parser(
        "up", parents=[where], help="start a SuperLink and N SuperNodes"
    )
    up.add_argument(
        "--nodes", type=_int_in(1, 1000), default=3, help="SuperNodes (default 3)"
    )
    up.add_argument("--host", default="127.0.0.1",
                    help="address the SuperLink listens on (default 127.0.0.1)")  # fmt: skip
    up.add_argument(
        "--port",
        type=_int_in(1, 65535),
        default=9093,
        help="SuperLink port (default 9093)",
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
        "--executor", choices=cluster.EXECUTORS, default="warm",
        help="ClientApp processes: warm (`pollen superexec`, forked from a "
        "preloaded parent; default) or cold (Flower's, one per message)",
    )  # fmt: skip
    add_poll_interval(up)
    add_pull_hold(up)
    up.add_argument(
        "--superlink-state", choices=cluster.SUPERLINK_STATES, default="memory",
        help="where the SuperLink keeps its state: memory (Flower's default, faster "
        "rounds, lost on restart) or file (superlink.db: `restart superlink` keeps "
        "the registered SuperNodes and the runs)",
    )  # fmt: skip


def _add_multi_machine_actions(actions: argparse._SubParsersAction) -> None:
    """`pollen deploy certs`, `key` and `register`: the certificates, keys and
    registrations of a deployment across machines (no `--dir`)."""
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


def main(argv: Sequence[str] | None = None) -> int:
    without_telemetry()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "superexec":  # every other flag is flower-superexec's
        from .deployment import superexec

        return superexec.main(rest)
    if args.command == "supernode":  # every other flag is flower-supernode's
        return supernode.main(rest)
    if args.command == "superlink":  # every other flag is flower-superlink's
        return superlink.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.handler(args) or 0)
    except EXPECTED_ERRORS as err:
        print(f"pollen: error: {err}", file=sys.stderr)
        return exit_code(err)


if __name__ == "__main__":
    sys.exit(main())
