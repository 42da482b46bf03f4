"""PSNR and SSIM by hand and against scikit-image, pairing reconstructions
with their originals, the picture."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from pollen.audit.images import pair_up, psnr, ssim, write_picture

# scikit-image 0.26.0's structural_similarity(a, b, gaussian_weights=True,
# sigma=1.5, use_sample_covariance=False, data_range=1.0, channel_axis=0) on
# `noisy_pair(shape)`
SKIMAGE_SSIM = {
    (1, 28, 28): 0.8114030740917214,
    (3, 32, 32): 0.8247072936760383,
    (1, 11, 11): 0.8866162622900913,
    (3, 20, 33): 0.8279528071042327,
}


def noisy_pair(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """An image of uniform pixels and the same plus clipped noise (seeded
    per shape)."""
    generator = np.random.default_rng(list(shape))
    image = generator.random(shape)
    return image, np.clip(image + 0.2 * generator.standard_normal(shape), 0, 1)


def test_identical_images() -> None:
    image = noisy_pair((3, 16, 16))[0]
    assert psnr(image, image) == math.inf
    assert ssim(image, image) == pytest.approx(1.0, abs=1e-12)


def test_psnr_of_a_constant_offset() -> None:
    image = np.full((1, 8, 8), 0.5)
    assert psnr(image, image + 0.1) == pytest.approx(20.0)  # 10 log10(1 / 0.01)
    assert psnr(image, image + 0.1, data_range=2.0) == pytest.approx(
        10 * math.log10(4 / 0.01)
    )
    assert psnr(torch.tensor(image), torch.tensor(image - 0.1)) == pytest.approx(20.0)


def test_ssim_of_two_flat_images_by_hand() -> None:
    """No variance: SSIM = (2 a b + C1) / (a^2 + b^2 + C1), C1 = 0.01^2."""
    c1 = 0.01**2
    expected = (2 * 0.5 * 0.25 + c1) / (0.5**2 + 0.25**2 + c1)
    value = ssim(np.full((1, 12, 12), 0.5), np.full((1, 12, 12), 0.25))
    assert value == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("shape", list(SKIMAGE_SSIM))
def test_ssim_equals_scikit_image_recorded(shape: tuple[int, ...]) -> None:
    assert ssim(*noisy_pair(shape)) == pytest.approx(SKIMAGE_SSIM[shape], abs=1e-6)


@pytest.mark.parametrize("shape", [*SKIMAGE_SSIM, (3, 64, 48)])
def test_ssim_equals_scikit_image(shape: tuple[int, ...]) -> None:
    metrics = pytest.importorskip("skimage.metrics")
    a, b = noisy_pair(shape)
    expected = metrics.structural_similarity(
        a,
        b,
        gaussian_weights=True,
        sigma=1.5,
        use_sample_covariance=False,
        data_range=1.0,
        channel_axis=0,
    )
    assert ssim(a, b) == pytest.approx(expected, abs=1e-6)


def test_bad_images_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 11 x 11"):
        ssim(np.zeros((1, 10, 28)), np.zeros((1, 10, 28)))
    with pytest.raises(ValueError, match=r"\(C, H, W\) of one shape"):
        psnr(np.zeros((1, 28, 28)), np.zeros((3, 28, 28)))
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        psnr(np.zeros((28, 28)), np.zeros((28, 28)))


def test_pairs_follow_the_best_psnr() -> None:
    generator = np.random.default_rng(0)
    originals = generator.random((4, 1, 12, 12))
    order = [2, 0, 3, 1]
    rebuilt = originals[order] + 0.05 * generator.standard_normal((4, 1, 12, 12))
    # each original's reconstruction: where it went in `order`
    assert pair_up(originals, rebuilt) == [1, 3, 0, 2]
    extra = np.concatenate([generator.random((2, 1, 12, 12)), rebuilt])
    assert pair_up(originals, extra) == [3, 5, 2, 4]
    # a perfect match (infinite PSNR) is still the best one
    assert pair_up(originals[:2], originals[::-1]) == [3, 2]


def test_pairs_need_enough_reconstructions() -> None:
    with pytest.raises(ValueError, match="3 originals cannot each"):
        pair_up(np.zeros((3, 1, 4, 4)), np.zeros((2, 1, 4, 4)))


@pytest.mark.parametrize("channels", [1, 3])
def test_the_picture(tmp_path: Path, channels: int) -> None:
    generator = np.random.default_rng(channels)
    originals = generator.random((3, channels, 28, 28))
    rebuilt = torch.tensor(originals + 0.1 * generator.standard_normal(originals.shape))
    captions = [
        f"PSNR {psnr(a, b):.1f} / SSIM {ssim(a, b):.2f}"
        for a, b in zip(originals, rebuilt, strict=True)
    ]
    path = tmp_path / "audit.png"
    write_picture(path, originals, rebuilt, captions)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = imread(path).shape[:2]
    assert width > height  # three columns, two rows


def test_the_picture_refuses_mismatches(tmp_path: Path) -> None:
    images = np.zeros((2, 1, 8, 8))
    with pytest.raises(ValueError, match="1 captions for 2"):
        write_picture(tmp_path / "a.png", images, images, ["one"])
    with pytest.raises(ValueError, match="1 or 3"):
        write_picture(tmp_path / "a.png", images, np.zeros((2, 2, 8, 8)), ["a", "b"])
