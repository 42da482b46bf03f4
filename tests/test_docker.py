"""The docker-compose deployment, for real.

The project image is built FROM a base made here (tests/docker_image.py says
how, and why in the background). docker-compose.yml then runs a SuperLink
and two SuperNodes with TLS, one training on a shard of real MNIST, one on a
file of its own, and `docker compose run submit` runs 2 rounds of FedAvg
whose results are read on the host.

Every service runs the project image with a user's package added the way
docs/extending.md documents it (an image FROM pollen's, the package on
PYTHONPATH), so the same federation also trains a user's model with a
user's aggregation rule.

Everything it builds or starts is removed afterwards (containers, network,
volumes, images, and the Docker daemon when it started one), except the base
root file system, which is cached in ~/.cache/pollen/docker.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pollen.deployment.certificates import make_node_key
from pollen.deployment.processes import free_port
from tests.conftest import PROJECT, write_mnist_slices
from tests.docker_image import BUILD, run
from tests.user_package import PACKAGE, write_user_package

COMPOSE = str(Path(sys.executable).parent / "docker-compose")
RUN_CONFIG = (
    'data-set="mnist" download=false num-clients=2 rounds=2 client-frac=1.0 '
    'local-epochs=1 batch-size=32 lr=0.05 run-name="compose" min-available-nodes=2'
)


def compose_config(*files: str, **env: str) -> dict:
    """`docker compose config` of `files` (relative to the project), as JSON."""
    command = [COMPOSE, *(a for f in files for a in ("-f", str(PROJECT / f)))]
    result = subprocess.run(
        [*command, "config", "--format", "json"],
        capture_output=True, text=True, env={**os.environ, **env}, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def command_of(service: dict) -> str:
    return " ".join(service.get("command") or [])


def test_single_machine_file_runs_tls_and_two_distinct_registered_nodes() -> None:
    services = compose_config("docker-compose.yml")["services"]
    assert {"certs", "keys", "superlink", "register", "supernode-0", "supernode-1"} <= (
        set(services)
    )
    link = command_of(services["superlink"])
    assert "--ssl-certfile=/certs/server.pem" in link and "--insecure" not in link
    assert "--enable-supernode-auth" in link
    done = "service_completed_successfully"
    assert services["superlink"]["depends_on"]["certs"]["condition"] == done
    assert services["register"]["depends_on"]["keys"]["condition"] == done
    configs, keys, states = [], [], []
    for name in ("supernode-0", "supernode-1"):
        node = services[name]
        assert "--root-certificates /certs/ca.pem" in command_of(node)
        assert '--auth-supernode-private-key "/keys/$$POLLEN_NODE_KEY"' in (
            command_of(node)
        )
        assert "--insecure" not in command_of(node).split("pollen superexec")[0]
        # ClientApps run in warm processes of `pollen superexec` beside the node
        assert "--isolation process --host 127.0.0.1 --port 9094" in command_of(node)
        assert "exec pollen superexec --parent-pid $$!" in command_of(node)
        assert node["depends_on"]["register"]["condition"] == done
        assert node["deploy"]["resources"]["limits"]["memory"]
        configs.append(node["environment"]["POLLEN_NODE_CONFIG"])
        keys.append(node["environment"]["POLLEN_NODE_KEY"])
        states += [v["source"] for v in node["volumes"] if v["target"] == "/state"]
    assert keys == ["node-0", "node-1"]
    assert configs == [
        'partition-id=0 num-partitions=2 data-root="/data"',
        'partition-id=1 num-partitions=2 data-root="/data"',
    ]
    assert len(set(states)) == 2, "each node keeps its state in its own volume"


def test_gpu_override_reserves_nvidia_devices_for_every_node() -> None:
    services = compose_config("docker-compose.yml", "docker-compose.gpu.yml")[
        "services"
    ]
    for name in ("supernode-0", "supernode-1"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        # the CUDA image: PyPI's torch, from the same Dockerfile and context
        assert services[name]["image"] == "pollen:gpu"
        assert services[name]["build"]["args"]["TORCH_INDEX_URL"] == ""
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile"
    # the server side keeps the CPU image, from PyTorch's CPU index
    assert services["superlink"]["image"] == "pollen:latest"
    assert services["superlink"]["build"]["args"]["TORCH_INDEX_URL"] == (
        "https://download.pytorch.org/whl/cpu"
    )
    assert "reservations" not in services["superlink"].get("deploy", {}).get(
        "resources", {}
    )


def test_multi_machine_files_take_the_other_side_from_the_environment() -> None:
    server = compose_config(
        "docker/compose.server.yml", POLLEN_SUPERLINK_HOST="fl.example.org"
    )["services"]
    assert set(server) == {"certs", "superlink", "register"}  # `submit`: profile cli
    assert command_of(server["certs"]).endswith(
        "superlink localhost 127.0.0.1 fl.example.org"
    )
    node = compose_config(
        "docker/compose.node.yml",
        "docker/compose.node-gpu.yml",
        POLLEN_SUPERLINK="fl.example.org:9093",
        POLLEN_NODE_CONFIG='partition-id=3 num-partitions=5 data-file="/data/a.npz"',
    )["services"]["supernode"]
    assert node["environment"]["POLLEN_SUPERLINK"] == "fl.example.org:9093"
    assert node["environment"]["POLLEN_NODE_CONFIG"].startswith("partition-id=3")
    assert node["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == (
        "nvidia"
    )


# --- the real thing ---------------------------------------------------------


@pytest.fixture(scope="module")
def docker_image() -> Iterator[str]:
    """The project image, built through docker/Dockerfile FROM a local base
    (tests/docker_image.py; conftest starts the build when the session
    begins), or POLLEN_TEST_IMAGE for quick iterations on the compose files:
    an image already built, used as it is and kept."""
    if os.environ.get("POLLEN_TEST_IMAGE"):
        yield os.environ["POLLEN_TEST_IMAGE"]
        return
    try:
        yield BUILD.tag()
    finally:
        BUILD.close()


# docs/extending.md's Dockerfile for a user's package, FROM the image under test
USER_DOCKERFILE = f"""\
FROM {{image}}
COPY {PACKAGE}/ /opt/user-parts/{PACKAGE}/
ENV PYTHONPATH=/opt/user-parts
"""


@pytest.fixture(scope="module")
def user_image(docker_image: str, tmp_path_factory) -> Iterator[str]:
    """`docker_image` with the test's user package (tests/user_package.py)
    added as docs/extending.md says: built here, removed afterwards."""
    context = write_user_package(tmp_path_factory.mktemp("user-image"))
    (context / "Dockerfile").write_text(USER_DOCKERFILE.format(image=docker_image))
    tag = f"pollen-test-user:{secrets.token_hex(4)}"
    run("docker", "build", "--quiet", "-t", tag, str(context), timeout=300)
    try:
        yield tag
    finally:
        subprocess.run(["docker", "image", "rm", "--force", tag],
                       capture_output=True, check=False)  # fmt: skip


@dataclass
class Federation:
    compose: list[str]  # the docker compose command for this project
    env: dict[str, str]  # its settings (POLLEN_*)
    root: Path  # data, certificates and results on the host
    port: int  # the SuperLink's, published on loopback


@pytest.fixture(scope="module")
def federation(user_image, tmp_path_factory) -> Iterator[Federation]:
    """docker-compose.yml up on the image with a user's package: node 0 on a
    shard of real MNIST, node 1 on a file of its own, each from its own host
    directory, read-only."""
    root = tmp_path_factory.mktemp("compose")
    shared, silo = root / "data", root / "silo"
    write_mnist_slices(shared, silo / "own.npz")
    port = free_port()
    env = {
        **os.environ,
        "POLLEN_IMAGE": user_image,
        "POLLEN_PORT": f"127.0.0.1:{port}",  # published on loopback only
        "POLLEN_CERTS": str(root / "certs"),
        "POLLEN_KEYS": str(root / "keys"),
        "POLLEN_DATA": str(shared),
        "POLLEN_NODE_0_DATA": str(shared),
        "POLLEN_NODE_1_DATA": str(silo),
        "POLLEN_NODE_1_CONFIG": 'partition-id=1 num-partitions=2 data-file="/data/own.npz"',
        "POLLEN_RESULTS": str(root / "results"),
        "POLLEN_NODE_CPUS": "1",
    }
    compose = [COMPOSE, "-p", f"pollen-test-{secrets.token_hex(4)}", "-f",
               str(PROJECT / "docker-compose.yml")]  # fmt: skip
    try:
        run(*compose, "up", "--detach", "--no-build", env=env, timeout=300)
        # `up` exits 0 even when a one-shot service failed: ask each service.
        listing = run(*compose, "ps", "--all", "--format", "json", env=env).stdout
        states = {c["Service"]: c for c in map(json.loads, listing.splitlines())}
        for name in ("certs", "keys", "register"):
            assert states[name]["ExitCode"] == 0, run(*compose, "logs", name, env=env)
        for name in ("superlink", "supernode-0", "supernode-1"):
            assert states[name]["State"] == "running", states[name]["Status"]
        yield Federation(compose, env, root, port)
    finally:
        logs = subprocess.run([*compose, "logs", "--no-color"], env=env,
                              capture_output=True, text=True)  # fmt: skip
        (root / "compose.log").write_text(logs.stdout + logs.stderr)
        subprocess.run([*compose, "down", "--volumes", "--remove-orphans"],
                       env=env, capture_output=True, timeout=300)  # fmt: skip


@pytest.mark.xdist_group("docker")
@pytest.mark.integration
def test_superlink_speaks_only_tls_with_the_generated_certificate(
    federation: Federation,
) -> None:
    url = f"127.0.0.1:{federation.port}/health"
    certs = federation.root / "certs"
    context = ssl.create_default_context(cafile=certs / "ca.pem")
    with urllib.request.urlopen(f"https://{url}", context=context, timeout=10) as r:
        assert r.status == 200
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{url}", timeout=10)
    assert (certs / "server.key").stat().st_mode & 0o077 == 0


@pytest.mark.xdist_group("docker")
@pytest.mark.integration
def test_two_rounds_of_fedavg_land_on_the_host(federation: Federation) -> None:
    started = time.monotonic()
    submitted = run(*federation.compose, "run", "--rm", "submit",
                    "--run-config", RUN_CONFIG, env=federation.env, timeout=600)  # fmt: skip
    assert "completed 2 rounds" in submitted.stdout, submitted.stdout[-3000:]
    results = federation.root / "results" / "compose"
    summary = json.loads((results / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 2
    assert summary["final-accuracy"] > 0.8, summary
    rounds = json.loads((results / "history.json").read_text())
    assert [r["clients"] for r in rounds] == [[0, 1], [0, 1]]
    assert all(r["failures"] == [] and r["bytes-up"] > 0 for r in rounds)
    print(f"compose run: {time.monotonic() - started:.0f} s for 2 rounds")


@pytest.mark.xdist_group("docker")
@pytest.mark.integration
def test_a_users_model_and_aggregator_train_in_the_containers(
    federation: Federation,
) -> None:
    """The submitting container validates, the ServerApp aggregates with and
    both nodes' ClientApps train the user's parts, imported from the
    derived image's PYTHONPATH."""
    model, rule = f"{PACKAGE}.nets:tiny_net", f"{PACKAGE}.rules:UniformMean"
    config = RUN_CONFIG.replace('run-name="compose"', 'run-name="user-parts"')
    config += f" model='{model}' aggregator='{rule}'"
    submitted = run(*federation.compose, "run", "--rm", "submit",
                    "--run-config", config, env=federation.env, timeout=600)  # fmt: skip
    assert "completed 2 rounds" in submitted.stdout, submitted.stdout[-3000:]
    results = federation.root / "results" / "user-parts"
    rounds = json.loads((results / "history.json").read_text())
    assert [r["clients"] for r in rounds] == [[0, 1], [0, 1]]
    assert not any(r["failures"] for r in rounds) and rounds[-1]["accuracy"] > 0.5
    settings = json.loads((results / "settings.json").read_text())
    assert (settings["model"], settings["aggregator"]) == (model, rule)


@pytest.mark.xdist_group("docker")
@pytest.mark.integration
def test_a_supernode_with_an_unregistered_key_is_refused(
    federation: Federation, tmp_path: Path
) -> None:
    """Only keys in POLLEN_KEYS were registered: a stranger with the CA and a
    key of its own, on the project's network, is turned away."""
    make_node_key(tmp_path / "stranger")
    stranger = subprocess.run(
        [*federation.compose, "run", "--rm", "--no-deps", "--volume",
         f"{tmp_path}:/keys:ro", "--entrypoint", "flower-supernode", "supernode-1",
         "--superlink", "superlink:9093", "--root-certificates", "/certs/ca.pem",
         "--auth-supernode-private-key", "/keys/stranger",
         "--max-retries", "2", "--max-wait-time", "20"],
        env=federation.env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # flower-supernode reports its exit code 305 but, as a container's PID 1,
    # exits 0 (Flower 1.41): the refusal is read from what it says.
    assert "Exit Code: 305" in stranger.stdout + stranger.stderr, stranger.stdout[
        -2000:
    ]
    listing = run(*federation.compose, "run", "--rm", "--no-deps", "--entrypoint",
                  "flwr", "submit", "supernode", "list", "--format", "json",
                  env=federation.env)  # fmt: skip
    nodes = json.loads(listing.stdout[listing.stdout.index("{") :])["nodes"]
    assert sorted(n["status"] for n in nodes) == ["online", "online"]
