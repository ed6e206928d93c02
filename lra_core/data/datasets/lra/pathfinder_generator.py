"""Pathfinder-STYLE images in the LRA release layout, drawn by this project's own renderer.

The same task and file layout as the LRA release, not its images (those come from
drewlinsley/pathfinder's snakes2.py, whose statistics these only resemble). Each image has two
target contours of `contour_length` dashes and distractor contours of contour_length // 3 dashes
(20 // that many of them, as LRA's generator settings); label 1 puts the two dots on both ends
of one target contour, label 0 on one end of each.

  python -m lra_core.data.datasets.lra.pathfinder generate --out=DIR [--resolution=32 --contour_length=14
      --num=1000 --seed=0]
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib

import numpy as np

from lra_core.errors import ConfigError

_FOLDER_OF_LENGTH = {6: "curv_baseline", 9: "curv_contour_length_9", 14: "curv_contour_length_14"}
_SUPERSAMPLE = 4  # drawn at 4x and box-filtered down: anti-aliased dashes
_MAX_TURN = np.pi / 3  # largest bend between consecutive dashes
_GRID = 2  # occupancy cells per pixel when keeping contours apart
_TRIES = 100  # attempts per contour (and per image) before giving up
_BEND_TRIES = 8  # bends tried for one dash before its contour starts over


def generator_folder(contour_length: int) -> str:
  return _FOLDER_OF_LENGTH.get(contour_length, f"curv_contour_length_{contour_length}")


def _dash_cells(x0: float, y0: float, x1: float, y1: float) -> set[tuple[int, int]]:
  """Occupancy cells (x, y) along a segment, _GRID cells per pixel."""
  g = _GRID
  steps = int(math.hypot(x1 - x0, y1 - y0) * 2 * g) + 2
  return {(int(g * (x0 + (x1 - x0) * i / steps)), int(g * (y0 + (y1 - y0) * i / steps))) for i in range(steps + 1)}


def _dilate(cells: set[tuple[int, int]], radius: int) -> set[tuple[int, int]]:
  """The cells and all cells within `radius` of them (a square neighbourhood)."""
  span = range(-radius, radius + 1)
  return {(x + dx, y + dy) for x, y in cells for dx in span for dy in span}


def _draw_contour(rng, occupied: set, res: int, length: int, dash: float, gap: float, spacing: int):
  """A random chain of `length` dashes avoiding the `occupied` cells, or None.

  Each dash bends by at most _MAX_TURN from the one before; a dash that would leave the image
  or come within `spacing` cells of its own earlier dashes or touch `occupied` is redrawn with
  a new bend a few times before the whole contour starts over. Returns (dashes as
  [(x0, y0, x1, y1)], the cells within `spacing` of the contour).
  """
  low, high = 1.0 + gap, res - 1.0 - gap
  for _ in range(_TRIES):
    x, y = rng.uniform(low, high, 2)
    heading = rng.uniform(0, 2 * math.pi)
    bends = iter(rng.uniform(-_MAX_TURN, _MAX_TURN, length * _BEND_TRIES).tolist())
    own: set[tuple[int, int]] = set()
    dashes, previous = [], set()
    for _ in range(length):
      for _ in range(_BEND_TRIES):
        angle = heading + next(bends) if dashes else heading
        dx, dy = math.cos(angle), math.sin(angle)
        x1, y1 = x + dash * dx, y + dash * dy
        if low <= x1 <= high and low <= y1 <= high:
          cells = _dash_cells(x, y, x1, y1)
          if occupied.isdisjoint(cells) and own.isdisjoint(cells):
            break
      else:
        break
      own |= _dilate(previous, spacing)  # only now: a dash is always near the one before it
      dashes.append((x, y, x1, y1))
      previous, heading = cells, angle
      x, y = x1 + gap * dx, y1 + gap * dy
    else:
      return dashes, own | _dilate(previous, spacing)
  return None


def _point_segment_distance(px: float, py: float, dash: tuple[float, float, float, float]) -> float:
  x0, y0, x1, y1 = dash
  vx, vy = x1 - x0, y1 - y0
  t = min(max(((px - x0) * vx + (py - y0) * vy) / (vx * vx + vy * vy), 0.0), 1.0)
  return math.hypot(px - x0 - t * vx, py - y0 - t * vy)


@dataclasses.dataclass(frozen=True)
class Scene:
  """What one image shows, in pixel coordinates: contours of dashes (x0, y0, x1, y1), the first
  two being the targets, and the two dots."""

  resolution: int
  contours: list[list[tuple[float, float, float, float]]]
  dots: tuple[tuple[float, float], tuple[float, float]]
  label: int  # 1 = both dots end the first contour; 0 = one ends each target contour


def _sizes(resolution: int) -> tuple[float, float, float, float]:
  """(dash length, gap, dash width, dot radius) in pixels.

  At 32x32: dashes 2 px long, 1 px gaps and dots of radius 1.5 px, as LRA's settings, scaled
  with the resolution; dashes are 1 px wide (LRA: 0.5 in snakes2's own units) to look as
  bright as the release's.
  """
  unit = resolution / 32
  return 2 * unit, unit, unit, 1.5 * unit


def sample_scene(rng: np.random.Generator, resolution: int, contour_length: int) -> Scene:
  """Draws two target contours, the distractors around them, the label and the dots.

  Different contours stay more than a gap apart (`spacing` cells), and every contour but its
  own stays more than a gap away from the dot at each target end, so the only chain of dashes
  no further apart than a gap is a contour itself: the label is what the picture shows.
  """
  dash, gap, _, radius = _sizes(resolution)
  spacing = int(gap * _GRID) + 1  # cells 1 + spacing apart are more than a gap apart
  clear = radius + gap + 1  # pixels around a target end that other contours avoid
  short = max(contour_length // 3, 1)
  label = int(rng.integers(2))
  for _ in range(_TRIES):
    occupied: set[tuple[int, int]] = set()
    targets: list = []
    for _ in range(2):
      contour = _draw_contour(rng, occupied, resolution, contour_length, dash, gap, spacing)
      if contour is None:
        break
      dashes, cells = contour
      ends = [dashes[0][:2], dashes[-1][2:]]
      if any(_point_segment_distance(x, y, d) <= clear for x, y in ends for t in targets for d in t):
        break  # an end of the second target too close to the first: its dot would touch it
      targets.append(dashes)
      occupied |= cells
      occupied |= _dilate({(int(x * _GRID), int(y * _GRID)) for x, y in ends}, math.ceil(clear * _GRID))
    if len(targets) == 2:
      break
  else:
    raise ConfigError(
      f"two contours of contour_length {contour_length} dashes do not fit in a "
      f"{resolution}x{resolution} image; use a larger resolution or a shorter contour."
    )
  contours = list(targets)
  for _ in range(20 // short):
    contour = _draw_contour(rng, occupied, resolution, short, dash, gap, spacing)
    if contour is not None:  # a crowded image keeps fewer distractors
      contours.append(contour[0])
      occupied |= contour[1]
  ends = [(c[0][:2], c[-1][2:]) for c in targets]
  if label:
    dots = ends[0]
  else:
    dots = (ends[0][int(rng.integers(2))], ends[1][int(rng.integers(2))])
  return Scene(resolution, contours, dots, label)


def render(scene: Scene) -> np.ndarray:
  """uint8[res, res]: white dashes and dots on black, drawn at 4x and box-filtered down."""
  from PIL import Image, ImageDraw

  _, _, width, radius = _sizes(scene.resolution)
  s, res = _SUPERSAMPLE, scene.resolution
  canvas = Image.new("L", (res * s, res * s), 0)
  pen = ImageDraw.Draw(canvas)
  for contour in scene.contours:
    for x0, y0, x1, y1 in contour:
      pen.line([(x0 * s, y0 * s), (x1 * s, y1 * s)], fill=255, width=max(int(round(width * s)), 1))
  for x, y in scene.dots:
    pen.ellipse([(x - radius) * s, (y - radius) * s, (x + radius) * s, (y + radius) * s], fill=255)
  return np.asarray(canvas.resize((res, res), Image.Resampling.BOX))


def generate(
  out: str | os.PathLike,
  *,
  resolution: int = 32,
  contour_length: int = 14,
  num: int = 1000,
  batch_size: int = 1000,
  seed: int = 0,
) -> pathlib.Path:
  """Writes `num` Pathfinder-style images in the release layout under out/<difficulty folder>/."""
  from PIL import Image

  for name, value, low in (
    ("resolution", resolution, 16),
    ("contour_length", contour_length, 2),
    ("num", num, 1),
    ("batch_size", batch_size, 1),
  ):
    if value < low:
      raise ConfigError(f"{name} {value} must be at least {low}.")
  folder = pathlib.Path(out) / generator_folder(contour_length)
  rng = np.random.default_rng(seed)
  short = max(contour_length // 3, 1)
  for batch in range(-(-num // batch_size)):
    (folder / "imgs" / str(batch)).mkdir(parents=True, exist_ok=True)
    (folder / "metadata").mkdir(parents=True, exist_ok=True)
    lines = []
    for k in range(batch * batch_size, min(num, (batch + 1) * batch_size)):
      scene = sample_scene(rng, resolution, contour_length)
      Image.fromarray(render(scene), mode="L").save(folder / "imgs" / str(batch) / f"sample_{k}.png")
      # As the release: index, label, continuity, contour length, distractor length, then settings.
      lines.append(f"imgs/{batch} sample_{k}.png {k} {scene.label} 1.0 {contour_length} {short} 2 0.5 1 1\n")
    (folder / "metadata" / f"{batch}.npy").write_text("".join(lines))
  return folder
