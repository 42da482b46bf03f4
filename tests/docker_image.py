"""The project's Docker image for tests/test_docker.py, built in the background.

No image registry is reachable from these machines, so the image is built
FROM a base made here (a Debian root file system from `debootstrap`, imported
with `docker import`) through docker/Dockerfile, its build reaching PyPI
through this machine's proxy with the proxy's CA passed in the documented way
(docker/ca-certificates/). That takes about three minutes, mostly waiting on
the network and the disk (PyPI's torch is a CUDA build of several GB), so
conftest starts it in a thread as soon as the session has collected a test
that needs it, and the tests that run meanwhile hide its cost. The build
context is a copy of the files .dockerignore lets in, so nothing is written
into the project while other tests read it.

Everything made here is removed by `close` (the image, the base image, the
Docker daemon when one was started here), except the base root file system,
which is cached in ~/.cache/pollen/docker. A Docker engine (Debian's
docker.io) and debootstrap are installed when missing.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from pollen.deployment import processes
from tests.conftest import PROJECT, SHARED_DATA

BASE_PACKAGES = "python3,python3-venv,ca-certificates"
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


def base_root_fs() -> Path:
    """A minimal Debian with Python as a tar archive, made once per machine."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    packages = hashlib.sha256(BASE_PACKAGES.encode()).hexdigest()[:12]
    archive = cache / "pollen" / "docker" / f"debian-bookworm-{packages}.tar"
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
    return into


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
        """Remove the images, stop a daemon started here. A `docker build`
        still running (an interrupted session) is stopped first."""
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
            token = secrets.token_hex(4)
            base, project = f"pollen-test-base:{token}", f"pollen-test:{token}"
            run("docker", "import", str(base_root_fs()), base)
            self._images.append(base)
            context = build_context(self._work / "context")
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
