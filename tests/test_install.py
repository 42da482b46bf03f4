"""`pip install pollen-fl` beside a user's own torch keeps that torch.

pollen's requirements are ranges (pyproject.toml), not the exact pins of
uv.lock: a researcher whose environment already holds a torch in the range
(a CUDA build of their own, say) must keep it. Checked as that user would
see it: a fresh virtual environment holding the oldest torch and
torchvision pollen supports, and pip's own plan for installing pollen
there (`pip install --dry-run --report`), from the package index."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UV = Path(sys.executable).with_name("uv")  # flwr's own dependency


def lower_bounds() -> dict[str, str]:
    """The oldest torch and torchvision pollen's requirements admit."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {}
    for requirement in project["dependencies"]:
        if match := re.fullmatch(r"(torch|torchvision)>=([\d.]+),<[\d.]+", requirement):
            bounds[match[1]] = match[2]
    return bounds


def test_the_requirements_are_ranges_for_torch():
    assert sorted(lower_bounds()) == ["torch", "torchvision"]


@pytest.mark.integration
def test_installing_pollen_keeps_the_oldest_supported_torch(tmp_path: Path) -> None:
    user = tmp_path / "user-env"
    subprocess.run([str(UV), "venv", "--quiet", "--seed", "--python", sys.executable,
                    str(user)], check=True, timeout=120)  # fmt: skip
    python = user / "bin" / "python"
    own = [f"{name}=={version}" for name, version in lower_bounds().items()]
    # the user's torch, without its CUDA libraries (what pip plans is the point)
    subprocess.run([str(UV), "pip", "install", "--quiet", "--python", str(python),
                    "--no-deps", *own], check=True, timeout=600)  # fmt: skip
    report = tmp_path / "report.json"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--isolated", "--quiet", "--dry-run",
         "--report", str(report), str(ROOT)],
        check=True, timeout=600,
    )  # fmt: skip
    planned = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "pollen-fl" in planned and "flwr" in planned
    assert "torch" not in planned and "torchvision" not in planned, planned
