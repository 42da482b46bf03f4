"""Every change pollen makes to Flower's own code, in one place.

pollen runs Flower's own processes (SuperNode, SuperExec, ClientApp runtime,
ServerApp) and, in the processes it starts, changes a few of Flower's
private functions: waits that no setting reaches, and the ClientApp's
installation of a FAB it has installed already. Each change is a `Patch`:
the Flower functions it touches, what it changes, why, and the upstream
change it stands for (docs/flower-patches.md, generated from `PATCHES`).

A patch applies only where the installed Flower is a release it was
verified on: the source of every function it touches must be the one
recorded for that release (`TESTED_SOURCES`, a digest per function). On any
other Flower it is not applied: Flower's code runs as shipped, at Flower's
pace, and one warning line says which change is left out and why (`guard`).
tests/test_flower_patches.py fails when the installed Flower's sources are
not recorded, and checks every patch applied on a verified release and
cleanly left out otherwise; it runs on the locked Flower (`make test`) and
on the next one (`make test-flower-next`, `flower-next.txt`).

Verifying a new release: read the changed functions' sources against the
patches (a patch depends on what the table's "what" says: a sleep through
the module's `time`, a keyword default, a call from the runtime), then
record the release's digests with `python -m pollen.flower_patches`.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

START_CLIENT = "flwr.supernode.start_client_internal"
INFLATABLE = "flwr.supercore.inflatable.inflatable_utils"
SUPEREXEC_LOOP = "flwr.supercore.superexec.run_superexec"
PULL_OBJECTS = f"{INFLATABLE}:pull_objects"
PULL_AND_INFLATE = f"{INFLATABLE}:pull_and_inflate_object_from_tree"
SUPERLINK_APP = "flwr.superlink.main:_get_middleware"
SUPERLINK_SERVE = "flwr.superlink.cli.flower_superlink:_run_superlink_http_api"
FLEET_PULL_ROUTE = "flwr.superlink.routers.fleet.router:fleet_pull_messages"
RUNTIME_PUSH_ROUTE = "flwr.supercore.routers.runtime.router:push_messages"
RUNTIME_OBJECT_ROUTE = "flwr.supercore.routers.runtime.router:push_object"
RUNTIME_PUSH = "flwr.superlink.servicer.runtime.runtime_handlers:push_messages"
RAY_ACTOR = "flwr.simulation.ray_transport.ray_actor"

# A digest of the source of each Flower function pollen changes, as each
# verified release ships it (`source_digest`).
TESTED_SOURCES: dict[str, dict[str, str]] = {
    "1.42.0": {
        f"{START_CLIENT}:start_client_internal": "9e89a6eb68fbec68",
        f"{START_CLIENT}:_push_messages": "00bb86faffdec114",
        f"{START_CLIENT}:_pull_and_store_message": "eaf5d0e36dc34e4c",
        PULL_OBJECTS: "31bb2de46b450e6a",
        PULL_AND_INFLATE: "139811483a15e4a6",
        f"{SUPEREXEC_LOOP}:run_superexec": "91e7a33c5b898f33",
        f"{SUPEREXEC_LOOP}:_handle_launch_result": "19302e77dfb33968",
        "flwr.cli.install:install_from_fab": "481bd04cde582322",
        "flwr.cli.install:validate_and_install": "628b69fb852ae858",
        "flwr.supernode.runtime.run_clientapp:run_clientapp": "6ce09559f3a2f5dc",
        SUPERLINK_APP: "911d5e2a5aaf11ec",
        SUPERLINK_SERVE: "eb0d78b85f999576",
        FLEET_PULL_ROUTE: "0f9739ecca2af0de",
        RUNTIME_PUSH_ROUTE: "195c0dab8d020cdc",
        RUNTIME_OBJECT_ROUTE: "cea29ed48616b5b5",
        RUNTIME_PUSH: "03b2ea647465c032",
        f"{RAY_ACTOR}:pool_size_from_resources": "dec698571d396dc8",
        f"{RAY_ACTOR}:BasicActorPool": "68dd4f31bc6e4655",
    },
    # The nightly of 1.43: `_push_messages` also returns when no task is left
    # (it pushes nothing), `_pull_and_store_message` acknowledges a message
    # after storing it, `run_superexec` times its phases. Each still sleeps
    # through its module's `time`, and is called as before.
    "1.43.0.dev20261026": {
        f"{START_CLIENT}:start_client_internal": "9e89a6eb68fbec68",
        f"{START_CLIENT}:_push_messages": "01f6ebdb3fa19e52",
        f"{START_CLIENT}:_pull_and_store_message": "2a89b553ee15b9ca",
        PULL_OBJECTS: "31bb2de46b450e6a",
        PULL_AND_INFLATE: "139811483a15e4a6",
        f"{SUPEREXEC_LOOP}:run_superexec": "c3fbc314371f962e",
        f"{SUPEREXEC_LOOP}:_handle_launch_result": "19302e77dfb33968",
        "flwr.cli.install:install_from_fab": "481bd04cde582322",
        "flwr.cli.install:validate_and_install": "628b69fb852ae858",
        "flwr.supernode.runtime.run_clientapp:run_clientapp": "6ce09559f3a2f5dc",
        SUPERLINK_APP: "911d5e2a5aaf11ec",
        SUPERLINK_SERVE: "eb0d78b85f999576",
        FLEET_PULL_ROUTE: "0f9739ecca2af0de",
        RUNTIME_PUSH_ROUTE: "195c0dab8d020cdc",
        RUNTIME_OBJECT_ROUTE: "cea29ed48616b5b5",
        RUNTIME_PUSH: "b757faa848722b17",
        f"{RAY_ACTOR}:pool_size_from_resources": "dec698571d396dc8",
        f"{RAY_ACTOR}:BasicActorPool": "68dd4f31bc6e4655",
    },
}


@dataclass(frozen=True)
class Patch:
    """One change to Flower's code, in the processes `where` names."""

    key: str
    where: str  # the processes it changes
    applied_by: str  # pollen's function that applies it ("module:name")
    functions: tuple[str, ...]  # Flower's functions it depends on ("module:name")
    what: str
    why: str
    upstream: str  # the change in Flower it stands for
    left_out: str  # what the warning says stays as Flower ships it
    # the first release whose Flower makes the change itself (on it and later
    # the patch is not applied, and nothing is said); "" for none yet
    upstream_since: str = ""

    @property
    def releases(self) -> list[str]:
        """The Flower releases whose sources of `functions` are recorded and
        that need the change (before `upstream_since`)."""
        return [
            release
            for release, sources in TESTED_SOURCES.items()
            if all(name in sources for name in self.functions)
            and not self.made_upstream(release)
        ]

    def made_upstream(self, release: str) -> bool:
        """Whether Flower `release` makes this change itself."""
        from packaging.version import Version

        return bool(self.upstream_since) and Version(release) >= Version(
            self.upstream_since
        )


SUPERNODE_WAITS = Patch(
    key="supernode-waits",
    where="`pollen supernode`",
    applied_by="pollen.flower_waits:shorten_supernode_waits",
    functions=(
        f"{START_CLIENT}:start_client_internal",
        f"{START_CLIENT}:_push_messages",
        f"{START_CLIENT}:_pull_and_store_message",
        PULL_OBJECTS,
    ),
    what="The module's `time` becomes a clock whose sleeps last `--poll-interval` "
    "(0.1 s) after a message, then 5 % of the time since, never longer than "
    "Flower's; object pulls retry from 0.1 s, doubling up to 1 s.",
    why="Flower sleeps 3 s when a pull finds no message and 0.5 s between reply "
    "checks, and first retries a missing object after 1 s: a deployed round "
    "pays each one.",
    upstream="A poll interval in place of the constants 3 and 0.5 in "
    "`start_client_internal`; `PULL_INITIAL_BACKOFF` as a setting.",
    left_out="pollen supernode keeps Flower's idle waits",
)
SUPEREXEC_POLLS = Patch(
    key="superexec-polls",
    where="pollen's SuperExecs",
    applied_by="pollen.flower_waits:shorten_superexec_polls",
    functions=(
        f"{SUPEREXEC_LOOP}:run_superexec",
        f"{SUPEREXEC_LOOP}:_handle_launch_result",
    ),
    what="The task poll sleeps 0.1 s after a task was launched, then 5 % of the "
    "time since, never longer than Flower's interval.",
    why="A fixed 1 s poll delays every task; a fixed 0.1 s one costs an idle "
    "SuperLink 10 % of a core.",
    upstream="A poll that shortens after a launch, beside "
    "`FLWR_SUPEREXEC_TASK_POLL_INTERVAL`.",
    left_out="flower-superexec keeps Flower's idle waits",
)
CLIENTAPP_PULLS = Patch(
    key="clientapp-pulls",
    where="the warm executor's ClientApps",
    applied_by="pollen.flower_waits:shorten_clientapp_pulls",
    functions=(PULL_AND_INFLATE,),
    what="A message object the SuperNode has not pulled yet is retried after "
    "0.1 s, not 1 s.",
    why="A warm ClientApp starts at once, before its node has the message's "
    "objects, and would wait a second for them.",
    upstream="`PULL_INITIAL_BACKOFF` as a setting.",
    left_out="pollen superexec keeps Flower's idle waits",
)
SERVERAPP_PULLS = Patch(
    key="serverapp-pulls",
    where="pollen's ServerApp",
    applied_by="pollen.flower_waits:shorten_serverapp_pulls",
    functions=(PULL_OBJECTS,),
    what="A reply's objects that its node has not pushed yet are retried after "
    "0.1 s, not 1 s.",
    why="A reply is listed on the SuperLink before its objects are pushed: the "
    "server's first pull of them often fails.",
    upstream="`PULL_INITIAL_BACKOFF` as a setting.",
    left_out="pollen's ServerApp keeps Flower's idle waits",
)
SUPERNODE_REPLY_WAIT = Patch(
    key="supernode-reply-wait",
    where="`pollen supernode`",
    applied_by="pollen.flower_waits:end_reply_waits_without_task",
    functions=(f"{START_CLIENT}:_push_messages",),
    what="`_push_messages` stops waiting for a ClientApp's reply once no task is "
    "left to write one (unfinished: pending, starting or running), and pushes "
    "nothing.",
    why="Flower 1.42's SuperNode waits for a reply, without end, after every "
    "message it took: a task that ended without writing one leaves the node "
    "listed online (its heartbeats go on) but never taking a message again, "
    "the next run's included.",
    upstream="Flower's own from 1.43 (the nightly's `_push_messages` waits only "
    "while unfinished tasks remain).",
    left_out="pollen supernode waits for a ClientApp's reply as Flower 1.42 does",
    upstream_since="1.43.0.dev0",
)
SUPERLINK_LONG_POLL = Patch(
    key="superlink-long-poll",
    where="`pollen superlink`",
    applied_by="pollen.deployment.long_poll:hold_fleet_pulls",
    functions=(
        SUPERLINK_APP,
        SUPERLINK_SERVE,
        FLEET_PULL_ROUTE,
        RUNTIME_PUSH_ROUTE,
        RUNTIME_OBJECT_ROUTE,
        RUNTIME_PUSH,
    ),
    what="A middleware inside Flower's own holds a Fleet pull that would find "
    "nothing (its node's last pull found nothing, and no push named it since) "
    "until the ServerApp has pushed a message for the node and the message's "
    "objects, or `--pull-hold` s (20) pass; a stopping SuperLink lets held "
    "pulls go.",
    why="Every pull costs the SuperLink about 9 ms of CPU: a node that asks "
    "every 3 s picks a message up late, one that asks every 0.1 s loads the "
    "SuperLink with 0.09 cores per node.",
    upstream="A held (long-poll) `pull-messages` in the Fleet API.",
    left_out="pollen superlink answers every pull at once, as Flower does",
)
INSTALLED_FABS = Patch(
    key="installed-fabs",
    where="the warm executor's ClientApps",
    applied_by="pollen.deployment.installed_fab:reuse_installed_fabs",
    functions=(
        "flwr.cli.install:install_from_fab",
        "flwr.cli.install:validate_and_install",
        "flwr.supernode.runtime.run_clientapp:run_clientapp",
    ),
    what="A task whose FAB is installed already (every file there, at its size) "
    "uses that folder without unzipping the FAB.",
    why="Unzipping and hashing pollen's FAB took 0.1 to 0.35 s of a warm "
    "task's 0.7 to 1.1 s, every round.",
    upstream="Return an existing install folder before extracting, in "
    "`validate_and_install`'s caller.",
    left_out="pollen superexec installs each task's FAB as Flower does",
)
RAY_ACTOR_SHARE = Patch(
    key="ray-actor-share",
    where="`flwr-simulation` of a comparison's cells run at once on a Ray cluster",
    applied_by="pollen.deployment.flower_simulation:share_actor_pool",
    functions=(f"{RAY_ACTOR}:pool_size_from_resources", f"{RAY_ACTOR}:BasicActorPool"),
    what="A run's ClientApp actor pool is Flower's size divided by the runs "
    "sharing the cluster at once (`POLLEN_RAY_SHARE`), at least one actor.",
    why="Flower sizes each run's pool to every CPU of the cluster: of two runs "
    "at once, messages given to pending actors wait for the other run to end "
    "(the runs take turns, or wait on each other).",
    upstream="A cap on the actor pool in the simulation backend's config (beside "
    "`client_resources`).",
    left_out="each run starts an actor per CPU of the cluster, as Flower does",
)
PATCHES = (
    SUPERNODE_WAITS,
    SUPERNODE_REPLY_WAIT,
    SUPEREXEC_POLLS,
    CLIENTAPP_PULLS,
    SERVERAPP_PULLS,
    SUPERLINK_LONG_POLL,
    INSTALLED_FABS,
    RAY_ACTOR_SHARE,
)


def resolve(name: str) -> Callable[..., Any]:
    """The function `module:qualname` names."""
    module_name, _, function = name.partition(":")
    module = __import__(module_name, fromlist=[function])
    return getattr(module, function)


def source_digest(function: Callable[..., Any]) -> str:
    """The first 16 hex digits of the SHA-256 of `function`'s source."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def unchanged_reason(names: Sequence[str]) -> str:
    """Why Flower's functions `names` must stay as they are in this process
    (empty when the installed Flower is a release verified with them)."""
    import flwr

    recorded = TESTED_SOURCES.get(flwr.__version__)
    if recorded is None:
        tested = ", ".join(TESTED_SOURCES)
        return (
            f"Flower {flwr.__version__} is not a release it was tested with ({tested})"
        )
    try:
        changed = [n for n in names if source_digest(resolve(n)) != recorded.get(n)]
    except (OSError, TypeError) as err:  # an installation without its sources
        return f"cannot read Flower {flwr.__version__}'s source: {err}"
    if changed:
        return f"Flower {flwr.__version__} differs from the release tested: {', '.join(changed)}"
    return ""


def guard(patch: Patch) -> bool:
    """Whether `patch` may be applied in this process; if not, one warning
    line that says what stays as Flower ships it, and why (none where this
    Flower makes the change itself)."""
    import flwr

    if patch.made_upstream(flwr.__version__):
        return False
    reason = unchanged_reason(patch.functions)
    if reason:
        print(
            f"pollen: warning: {patch.left_out}: {reason}", file=sys.stderr, flush=True
        )
    return not reason


def render() -> str:
    """The patches as a Markdown table (docs/flower-patches.md)."""
    rows = [
        "| change | where | Flower functions | what | why | upstream | verified on |",
        "|---|---|---|---|---|---|---|",
    ]
    for patch in PATCHES:
        functions = "<br>".join(f"`{name}`" for name in patch.functions)
        cells = (
            f"`{patch.key}` (`{patch.applied_by.replace(':', '.')}`)", patch.where,
            functions, patch.what, patch.why, patch.upstream,
            ", ".join(patch.releases),
        )  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def installed_sources() -> dict[str, str]:
    """The digests of the installed Flower's functions that pollen changes:
    what `TESTED_SOURCES` records for a release once it is verified."""
    names = sorted({name for patch in PATCHES for name in patch.functions})
    return {name: source_digest(resolve(name)) for name in names}


if __name__ == "__main__":
    import flwr

    print(f"# Flower {flwr.__version__}")
    for name, digest in installed_sources().items():
        print(f'"{name}": "{digest}",')
