"""Shared fixtures: paths to the project and to the real benchmark data."""

from __future__ import annotations

from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
SHARED_DATA = PROJECT.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "mnist.npz").exists():
        pytest.skip(f"real MNIST not found at {SHARED_DATA}")
    return SHARED_DATA
