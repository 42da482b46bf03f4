"""How close a reconstruction is to the image it rebuilds, and a picture of both.

Images are (C, H, W) in pixel space, [0, 1] unless `data_range` says
otherwise: undo the model's normalisation (x * std + mean) first. PSNR is
10 log10(R^2 / MSE); SSIM is Wang et al. 2004's structural similarity,
https://ece.uwaterloo.ca/~z70wang/publications/ssim.pdf, eq. (13), with
their 11 x 11 Gaussian window of standard deviation 1.5, K1 = 0.01 and
K2 = 0.03, averaged over the positions where the window fits inside the
image and over the channels (the value scikit-image's
`structural_similarity(..., gaussian_weights=True, sigma=1.5,
use_sample_covariance=False)` gives).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from numpy.lib.stride_tricks import sliding_window_view
from scipy.optimize import linear_sum_assignment

Image = torch.Tensor | np.ndarray
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1 = 0.01
SSIM_K2 = 0.03


def psnr(original: Image, reconstruction: Image, data_range: float = 1.0) -> float:
    """10 log10(data_range^2 / MSE) in dB; inf for identical images."""
    a, b = _pair(original, reconstruction)
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(data_range**2 / mse)


def ssim(original: Image, reconstruction: Image, data_range: float = 1.0) -> float:
    """Wang et al.'s mean SSIM: per window position,

        ((2 mu_x mu_y + C1)(2 sigma_xy + C2))
        / ((mu_x^2 + mu_y^2 + C1)(sigma_x^2 + sigma_y^2 + C2)),

    C1 = (K1 R)^2, C2 = (K2 R)^2, the moments Gaussian-weighted over the
    window; the mean over the positions and the channels."""
    x, y = _pair(original, reconstruction)
    if min(x.shape[1:]) < SSIM_WINDOW:
        raise ValueError(
            f"SSIM needs images of at least {SSIM_WINDOW} x {SSIM_WINDOW} pixels, "
            f"not {x.shape[1]} x {x.shape[2]}"
        )
    mu_x, mu_y = _window_mean(x), _window_mean(y)
    var_x = _window_mean(x * x) - mu_x**2
    var_y = _window_mean(y * y) - mu_y**2
    cov = _window_mean(x * y) - mu_x * mu_y
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / (
        (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    )
    return float(index.mean())


def pair_up(originals: Image, reconstructions: Image) -> list[int]:
    """For each original (n, C, H, W), the index of its reconstruction among
    m >= n, one each, with the largest total PSNR (Hungarian assignment):
    an attack on a batch, or on a sum of k clients, does not say which
    reconstruction is which example."""
    if len(reconstructions) < len(originals):
        raise ValueError(
            f"{len(originals)} originals cannot each have their own "
            f"reconstruction among {len(reconstructions)}"
        )
    a = _array(originals).reshape(len(originals), -1)
    b = _array(reconstructions).reshape(len(reconstructions), -1)
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"originals {_array(originals).shape[1:]} and reconstructions "
            f"{_array(reconstructions).shape[1:]} differ in shape"
        )
    mse = ((a[:, None, :] - b[None, :, :]) ** 2).mean(axis=2)
    # PSNR = const - 10 log10(MSE); a perfect match is simply the best one
    cost = np.log10(np.maximum(mse, np.finfo(np.float64).tiny))
    rows, columns = linear_sum_assignment(cost)
    return [int(column) for _, column in sorted(zip(rows, columns, strict=True))]


def write_picture(
    path: Path | str,
    originals: Image,
    reconstructions: Image,
    captions: Sequence[str],
) -> None:
    """A PNG: the originals (n, C, H, W) in the top row, each one's
    reconstruction under it with its caption; grey for one channel, RGB for
    three, pixel values clipped to [0, 1]."""
    top, bottom = _array(originals), _array(reconstructions)
    if top.shape != bottom.shape or top.ndim != 4 or top.shape[1] not in (1, 3):
        raise ValueError(
            f"originals and reconstructions must both be (n, 1 or 3, H, W), "
            f"not {top.shape} and {bottom.shape}"
        )
    if len(captions) != len(top):
        raise ValueError(f"{len(captions)} captions for {len(top)} reconstructions")
    figure = Figure(figsize=(1.8 * len(top), 4.0))
    axes = figure.subplots(2, len(top), squeeze=False)
    for column, caption in enumerate(captions):
        for row, images in enumerate((top, bottom)):
            _show(axes[row][column], images[column])
        axes[1][column].set_title(caption, fontsize=8)
    axes[0][0].set_ylabel("original")
    axes[1][0].set_ylabel("reconstruction")
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)


def _show(axis: Axes, image: np.ndarray) -> None:
    """One (C, H, W) image on `axis`, without ticks."""
    pixels = np.clip(image, 0, 1)
    if pixels.shape[0] == 1:
        axis.imshow(pixels[0], cmap="gray", vmin=0, vmax=1)
    else:
        axis.imshow(pixels.transpose(1, 2, 0))
    axis.set_xticks([])
    axis.set_yticks([])


def _window_mean(image: np.ndarray) -> np.ndarray:
    """The Gaussian-weighted mean over every window that fits in the image,
    per channel: (C, H - 10, W - 10)."""
    offsets = np.arange(SSIM_WINDOW) - SSIM_WINDOW // 2
    weights = np.exp(-0.5 * (offsets / SSIM_SIGMA) ** 2)
    weights /= weights.sum()
    across = sliding_window_view(image, SSIM_WINDOW, axis=2) @ weights
    return sliding_window_view(across, SSIM_WINDOW, axis=1) @ weights


def _pair(original: Image, reconstruction: Image) -> tuple[np.ndarray, np.ndarray]:
    """Both images as float64 arrays, checked to be one (C, H, W) shape."""
    a, b = _array(original), _array(reconstruction)
    if a.shape != b.shape or a.ndim != 3:
        raise ValueError(
            f"the images must be (C, H, W) of one shape, not {a.shape} and {b.shape}"
        )
    return a, b


def _array(images: Image) -> np.ndarray:
    if isinstance(images, torch.Tensor):
        images = images.detach().cpu().numpy()
    return np.asarray(images, dtype=np.float64)
