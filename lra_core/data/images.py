"""Pixel-array helpers shared by the image datasets (ImageNet64, CIFAR-10, Pathfinder)."""

from __future__ import annotations

import numpy as np

from lra_core.errors import DataError


def planar_to_hwc(rows: np.ndarray, size: int, channels: int = 3) -> np.ndarray:
  """[N, C*H*W] channel-planar rows (the CIFAR / downsampled-ImageNet layout) -> [N, H, W, C]."""
  return rows.reshape(-1, channels, size, size).transpose(0, 2, 3, 1)


def downsample(images: np.ndarray, image_size: int) -> np.ndarray:
  """uint8 [..., H, W, C] -> [..., S, S, C]: mean of each (H/S)x(W/S) block, rounded half up."""
  *lead, h, w, c = images.shape
  if h % image_size or w % image_size:
    raise DataError(f"image size {h}x{w} is not a multiple of image_size {image_size}.")
  fh, fw = h // image_size, w // image_size
  if fh == fw == 1:
    return images
  blocks = images.reshape(*lead, image_size, fh, image_size, fw, c)
  total = blocks.sum(axis=-4, dtype=np.uint32).sum(axis=-2)  # one axis at a time: 4x faster
  area = fh * fw
  return ((total + area // 2) // area).astype(np.uint8)  # integer rounding: exact and portable


def flip_left_right(images: np.ndarray) -> np.ndarray:
  """[..., H, W, C] -> the mirror images (columns in reverse order)."""
  return np.asarray(images)[..., ::-1, :]
