"""pollen's changes to Flower's code (`pollen.flower_patches`): recorded for
the installed Flower, each one applied there, and cleanly left out on any
other. The suite runs on the locked Flower (`make test`) and on the next
release (`make test-flower-next`), so every patch is checked on both."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pollen import flower_patches
from pollen.flower_patches import PATCHES, TESTED_SOURCES

# What a patch changes, as seen from outside Flower's functions: each name an
# expression that is true in a process where that change was made.
OBSERVED = {
    "supernode clock": "node.time is not time",
    "superexec clock": "loop.time is not time",
    "object pulls": "utils.pull_objects.__kwdefaults__['initial_backoff'] < 1",
    "tree pulls": (
        "utils.pull_and_inflate_object_from_tree.__kwdefaults__['initial_backoff'] < 1"
    ),
    "FAB install": "runtime.install_from_fab is not install_from_fab",
    "reply wait": "type(node._push_messages).__name__ == 'PushWhileTasksRun'",
    "held pulls": "hasattr(superlink_app._get_middleware, '__wrapped__')",
    "released on exit": "hasattr(uvicorn.Server.handle_exit, '__wrapped__')",
    "actor share": "hasattr(getattr(sys.modules.get("
    "'flwr.simulation.ray_transport.ray_actor'), 'pool_size_from_resources', "
    "None), '__wrapped__')",
}
CHANGES = {  # a patch -> what it changes (the SuperNode's pulls are objects')
    "supernode-waits": ["supernode clock", "object pulls"],
    "supernode-reply-wait": ["reply wait"],
    "superexec-polls": ["superexec clock"],
    "clientapp-pulls": ["tree pulls"],
    "serverapp-pulls": ["object pulls"],
    "installed-fabs": ["FAB install"],
    "superlink-long-poll": ["held pulls", "released on exit"],
    "ray-actor-share": ["actor share"],
}


def apply_in_a_fresh_process(
    patch: flower_patches.Patch, tamper: str
) -> tuple[str, str]:
    """Apply `patch` after `tamper` in a new interpreter (patches change module
    globals); what it printed (whether it applied, what changed) and its stderr."""
    observed = ", ".join(f"{name!r}: {check}" for name, check in OBSERVED.items())
    code = (  # as a comparison's cells on a Ray cluster, two at once
        "import os, sys, time, flwr, uvicorn\n"
        "os.environ['POLLEN_RAY_SHARE'] = '2'\n"
        "from pollen import flower_patches\n"
        f"{tamper}\n"
        "from flwr.cli.install import install_from_fab\n"
        "from flwr.supercore.inflatable import inflatable_utils as utils\n"
        "from flwr.supercore.superexec import run_superexec as loop\n"
        "from flwr.supernode import start_client_internal as node\n"
        "from flwr.supernode.runtime import run_clientapp as runtime\n"
        "from flwr.superlink import main as superlink_app\n"
        f"applied = flower_patches.resolve({patch.applied_by!r})()\n"
        f"observed = {{{observed}}}\n"
        "print(applied, sorted(name for name, yes in observed.items() if yes))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip(), result.stderr


def test_the_installed_flower_is_a_verified_release():
    """Fails when the installed Flower is not recorded, or a function pollen
    changes differs from the recorded source: read the change against the
    patch (docs/flower-patches.md), then record the new digests
    (`python -m pollen.flower_patches` prints them)."""
    import flwr

    installed = flower_patches.installed_sources()
    # a release not recorded yet: against the newest recorded one
    against = (
        flwr.__version__
        if flwr.__version__ in TESTED_SOURCES
        else [*TESTED_SOURCES][-1]
    )
    changed = [
        n for n, digest in installed.items() if TESTED_SOURCES[against][n] != digest
    ]
    assert flwr.__version__ in TESTED_SOURCES, (
        f"no patch was verified on Flower {flwr.__version__}; changed since "
        f"{against}: {', '.join(changed) or 'none'}"
    )
    assert not changed, f"changed since {against} was verified: {', '.join(changed)}"


def test_every_patch_is_verified_on_every_recorded_release_and_tested_here():
    assert sorted(CHANGES) == sorted(patch.key for patch in PATCHES)
    touched = {name for patch in PATCHES for name in patch.functions}
    for release, sources in TESTED_SOURCES.items():
        assert set(sources) == touched, release
    for patch in PATCHES:
        needed = [r for r in TESTED_SOURCES if not patch.made_upstream(r)]
        assert patch.releases == needed and needed, patch.key


def test_a_change_flower_makes_itself_is_not_applied_there():
    reply_wait = next(p for p in PATCHES if p.key == "supernode-reply-wait")
    assert reply_wait.releases == ["1.42.0"]
    assert reply_wait.made_upstream("1.43.0.dev20261026")
    assert reply_wait.made_upstream("1.43.0") and not reply_wait.made_upstream("1.42.1")


@pytest.mark.parametrize("patch", PATCHES, ids=lambda patch: patch.key)
def test_a_patch_applies_on_a_verified_release(patch):
    """...and, where this Flower makes the change itself, is left out
    without a word."""
    import flwr

    shown, err = apply_in_a_fresh_process(patch, "")
    if patch.made_upstream(flwr.__version__):
        assert shown == "False []"
    else:
        assert shown == f"True {sorted(CHANGES[patch.key])}"
    assert err == ""


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (
            "flwr.__version__ = '1.41.9'",
            "Flower 1.41.9 is not a release it was tested with",
        ),
        (
            "flower_patches.TESTED_SOURCES[flwr.__version__] = {}",
            "differs from the release tested: {functions}",
        ),
    ],
    ids=["another release", "changed sources"],
)
@pytest.mark.parametrize("patch", PATCHES, ids=lambda patch: patch.key)
def test_a_patch_is_left_out_on_any_other_flower_with_one_warning(
    patch, tamper, reason
):
    """Flower's functions stay as it ships them, and one line says which change
    is left out and why (nothing, where this Flower makes the change itself)."""
    import flwr

    shown, err = apply_in_a_fresh_process(patch, tamper)
    assert shown == "False []"
    if patch.made_upstream(flwr.__version__) and "__version__ =" not in tamper:
        assert err == ""
        return
    assert len(err.splitlines()) == 1
    assert err.startswith(f"pollen: warning: {patch.left_out}: ")
    assert reason.format(functions=", ".join(patch.functions)) in err


def test_the_table_names_every_patch_and_its_releases():
    table = flower_patches.render().splitlines()
    assert len(table) == 2 + len(PATCHES)
    for patch, row in zip(PATCHES, table[2:], strict=True):
        assert row.startswith(f"| `{patch.key}` ")
        assert row.endswith(f"| {', '.join(patch.releases)} |")
