"""The project's Docker image for tests/test_docker.py, built once per machine.

No image registry is reachable from these machines, so the image is built
FROM a base made here (a Debian root file system from `debootstrap`, imported
with `docker import`) through docker/Dockerfile, its build reaching PyPI
through this machine's proxy with the proxy's CA passed in the documented way
(docker/ca-certificates/). The image is the CPU one: PyTorch's CPU index is
not reachable from here, so torch's CPU wheel comes from this machine's disk
(pip's find-links, where it keeps one) through docker/wheels/, the
Dockerfile's offline path, instead of PyPI's CUDA build (3.5 GB of
downloads). The build context is a copy of the files .dockerignore lets in,
so nothing is written into the project while other tests read it.

The build is paid once per machine: the base image (tagged by its root file
system's digest) and the last image built (`CACHE_TAG`) are kept, and Docker
reuses their layers, so a build after a change to pollen's code redoes only
the last layer. One build at a time on the machine (a file lock): two test
sessions, or two xdist workers, never build side by side. Run alone, a
session starts the build in a thread as soon as it has collected a test that
needs it (conftest), so the tests that run meanwhile hide its cost.

`close` removes what a session made for itself (its tag, the Docker daemon
when one was started here); the cached base root file system
(~/.cache/pollen/docker), the base image and `CACHE_TAG` stay. A Docker
engine (Debian's docker.io) and debootstrap are installed when missing.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pollen.deployment import processes
from tests.conftest import PROJECT, SHARED_DATA

BASE_PACKAGES = "python3,python3-venv,ca-certificates"
BASE_PYTHON = "cp311"  # Debian bookworm's python3, for the wheel's tag
CACHE_TAG = "pollen-test:cache"  # the last image built: the next build's layers
EXTRA_CAS = Path("/usr/local/share/ca-certificates")  # where Debian keeps added CAs
# the build context: what .dockerignore lets in
CONTEXT = (".dockerignore", "pyproject.toml", "uv.lock", "README.md", "pollen",
           "configs", "docker")  # fmt: skip


def run(*command: str, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    """Run `command`; fail with the end of its output when it fails."""
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    assert result.returncode == 0, (
        f"{' '.join(command)} exited {result.returncode}:\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    info = subprocess.run(["docker", "info"], capture_output=True, timeout=60)
    return info.returncode == 0


def install_engine() -> None:
    """Debian's docker.io (with its client and containerd) and debootstrap."""
    packages = ["docker.io", "debootstrap"]
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, capture_output=True, env=env).returncode != 0:
        run("apt-get", "update", "-q", env=env)
        run(*install, env=env)


def cache_dir() -> Path:
    """~/.cache/pollen/docker (or under XDG_CACHE_HOME): what outlives a session."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "pollen" / "docker"


@contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """Hold the machine-wide lock `name` (a file lock in `cache_dir`, released
    when the file closes)."""
    path = cache_dir() / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def base_root_fs() -> Path:
    """A minimal Debian with Python as a tar archive, made once per machine."""
    packages = hashlib.sha256(BASE_PACKAGES.encode()).hexdigest()[:12]
    archive = cache_dir() / f"debian-bookworm-{packages}.tar"
    if archive.exists():
        return archive
    archive.parent.mkdir(parents=True, exist_ok=True)
    root = archive.parent / f"rootfs-{secrets.token_hex(4)}"
    partial = archive.with_suffix(".partial")
    try:
        run(
            "debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}",
            "bookworm", str(root), "http://deb.debian.org/debian",
        )  # fmt: skip
        run("tar", "--create", "--file", str(partial), "--directory", str(root), ".")
        partial.rename(archive)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        partial.unlink(missing_ok=True)
    return archive


def image_id(reference: str) -> str | None:
    """The ID of the image `reference` names, or None where there is none."""
    found = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", reference],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return found.stdout.strip() if found.returncode == 0 else None


def base_image() -> str:
    """The base image, imported once per machine from `base_root_fs` and
    named by its digest: the same base ID is what lets Docker reuse the
    layers of earlier builds FROM it."""
    archive = base_root_fs()
    with archive.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()[:16]
    base = f"pollen-test-base:{digest}"
    if image_id(base) is None:
        run("docker", "import", str(archive), base)
    return base


def keep_as_cache(project: str) -> None:
    """Name `project` `CACHE_TAG`, and remove the image that held the name
    before (its layers below pollen's code are shared with `project`'s when
    the dependencies did not change; an image still in use stays)."""
    before = image_id(CACHE_TAG)
    run("docker", "tag", project, CACHE_TAG)
    if before is not None and before != image_id(project):
        subprocess.run(["docker", "rmi", before], capture_output=True, check=False)


def build_context(into: Path) -> Path:
    """A copy of the build context, with this machine's extra CAs (a
    proxy's) in docker/ca-certificates/, as users pass theirs."""
    ignore = shutil.ignore_patterns("__pycache__", "certs", "keys")
    into.mkdir(parents=True)
    for name in CONTEXT:
        source = PROJECT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=ignore)
        else:
            shutil.copy2(source, into / name)
    for ca in sorted(EXTRA_CAS.glob("*.crt")):
        shutil.copyfile(ca, into / "docker" / "ca-certificates" / f"test-{ca.name}")
    if wheel := cpu_torch_wheel():
        shutil.copyfile(wheel, into / "docker" / "wheels" / wheel.name)
    return into


def locked_version(package: str) -> str:
    """`package`'s version in uv.lock."""
    lock = tomllib.loads((PROJECT / "uv.lock").read_text())
    (version,) = {p["version"] for p in lock["package"] if p["name"] == package}
    return version


def cpu_torch_wheel() -> Path | None:
    """torch's CPU wheel of the locked version for the base's Python, where
    pip's find-links on this machine hold one (as these machines do)."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    if python := shutil.which("python3"):  # the machine's pip (the venv has none)
        pip = subprocess.run(
            [python, "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        links += pip.stdout.split() if pip.returncode == 0 else []
    pattern = f"torch-{locked_version('torch')}+cpu-{BASE_PYTHON}-{BASE_PYTHON}-*.whl"
    for folder in links:
        if found := sorted(Path(folder.removeprefix("file://")).glob(pattern)):
            return found[-1]
    return None


class ImageBuild:
    """The project image, built once per session in a thread of its own.

    `start` begins (it returns at once), `tag` waits for the image (or skips
    the test, with the reason, where this machine cannot build it), `close`
    removes what was made. The Docker daemon, when none answers, is started
    here and stopped by `close`."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._work = Path(tempfile.gettempdir()) / f"pollen-docker-{os.getpid()}"
        self._daemon: subprocess.Popen[bytes] | None = None
        self._building: subprocess.Popen[str] | None = None
        self._images: list[str] = []
        self._tag: str | None = None
        self._skip: str | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._build, name="docker-image", daemon=True
                )
                self._thread.start()

    def tag(self) -> str:
        """The built image's tag, once it is built."""
        self.start()
        assert self._thread is not None
        self._thread.join()
        if self._skip:
            pytest.skip(self._skip)
        if self._error is not None:
            raise self._error
        assert self._tag is not None
        return self._tag

    def close(self) -> None:
        """Remove this session's tag (the image stays as `CACHE_TAG`), stop a
        daemon started here. A `docker build` still running (an interrupted
        session) is stopped first."""
        if self._building is not None and self._building.poll() is None:
            self._building.terminate()
        if self._thread is not None:
            self._thread.join()
        if self._images:
            subprocess.run(["docker", "rmi", "--force", *self._images],
                           capture_output=True, check=False)  # fmt: skip
            self._images = []
        if self._daemon is not None:
            processes.stop_child(self._daemon, 60)
            self._daemon = None
        shutil.rmtree(self._work, ignore_errors=True)

    def _build(self) -> None:
        try:
            self._work.mkdir(parents=True, exist_ok=True)
            self._skip = self._engine()
            if self._skip:
                return
            project = f"pollen-test:{secrets.token_hex(4)}"
            context = build_context(self._work / "context")
            with machine_lock("build"):
                base = base_image()
                self._images.append(project)
                self._building = subprocess.Popen(
                    ["docker", "build", "--file", str(context / "docker" / "Dockerfile"),
                     "--build-arg", f"BASE_IMAGE={base}", "--build-arg", "TORCH_INDEX_URL=",
                     "--tag", project, str(context)],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    env={**os.environ, "DOCKER_BUILDKIT": "0"},
                )  # fmt: skip
                output, _ = self._building.communicate(timeout=1500)
                assert self._building.returncode == 0, (
                    f"docker build exited {self._building.returncode}:\n{output[-5000:]}"
                )
                keep_as_cache(project)
            self._tag = project
        except BaseException as error:
            self._error = error

    def _engine(self) -> str | None:
        """A Docker engine that answers (started here when needed), or the
        reason there is none."""
        if not (SHARED_DATA / "mnist.npz").exists():
            return f"real MNIST not at {SHARED_DATA}"
        if docker_answers():
            if shutil.which("debootstrap") is None:
                install_engine()
            return None
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return "no Docker engine, and installing one needs root and apt-get"
        if shutil.which("dockerd") is None or shutil.which("debootstrap") is None:
            install_engine()
        log = self._work / "dockerd.log"
        self._daemon = processes.start(["dockerd"], log=log)
        processes.wait_ready(
            self._daemon.pid, docker_answers, name="dockerd", log=log, timeout=60
        )
        return None


BUILD = ImageBuild()
