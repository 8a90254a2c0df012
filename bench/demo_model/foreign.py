"""Scenes drawn by code that is not the training generator: the demo model's test of seeing shapes, not a style.

`dataset.py` draws every training image the same way (anti-aliased polygons from one outline function, sizes
0.17-0.29 of the side, centred in 3x3 grid cells, the palette's exact colours, 384x384). These scenes use PIL's and
OpenCV's own primitives (ellipse, rectangle, regular polygon, fillPoly, cv2.circle), shape sizes outside the
generator's ranges, free positions, colours shifted away from the palette's values, and image sizes other than 384,
as a new user's first picture would be. A caption passes when it names exactly the scene's shapes by kind and colour
(no shape missed, none invented); positions and sizes are not scored, as the generator's words for them do not map
onto free placement.

    python -m bench.demo_model.foreign [--n 240] [--model FOLDER]    # prints the accuracy and its parts
"""
from __future__ import annotations

import argparse
import math
import random
import tempfile
from collections import Counter
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, ImageDraw

from . import dataset

FOREIGN_SEED = 4242
# Shape diameters as a fraction of the image side, on both sides of the generator's 0.17-0.29.
DIAMETERS = ((0.11, 0.15), (0.32, 0.55))
IMAGE_SIZES = ((256, 256), (512, 512), (448, 320), (320, 480), (600, 600))
COLOUR_SHIFT = 28  # each channel moves up to this far from the palette, staying nearest its own name


@dataclass(frozen=True)
class ForeignShape:
    kind: str
    colour: str
    rgb: tuple[int, int, int]
    centre: tuple[float, float]  # pixels
    radius: float  # half the diameter, pixels


@dataclass(frozen=True)
class ForeignScene:
    shapes: tuple[ForeignShape, ...]
    background: str
    background_rgb: tuple[int, int, int]
    size: tuple[int, int]  # width, height
    drawer: str  # "pil" or "opencv"


def _nearest(rgb: tuple[int, int, int]) -> str:
    return min(dataset.COLOURS, key=lambda name: sum((a - b) ** 2 for a, b in zip(rgb, dataset.COLOURS[name])))


def _shifted(rng: random.Random, name: str) -> tuple[int, int, int]:
    """A colour the generator never paints, still nearest to `name` in the palette."""
    while True:
        rgb = tuple(min(255, max(0, c + rng.randint(-COLOUR_SHIFT, COLOUR_SHIFT))) for c in dataset.COLOURS[name])
        if rgb != dataset.COLOURS[name] and _nearest(rgb) == name:
            return rgb


def random_foreign_scene(rng: random.Random, drawer: str) -> ForeignScene:
    width, height = rng.choice(IMAGE_SIZES)
    background = rng.choice(list(dataset.COLOURS))
    shapes: list[ForeignShape] = []
    for _ in range(rng.randint(1, 2)):
        for _attempt in range(50):  # free placement: retry until the shape stays inside and clear of the other
            radius = rng.uniform(*rng.choice(DIAMETERS)) * min(width, height) / 2
            centre = (rng.uniform(radius, width - radius), rng.uniform(radius, height - radius))
            if all(math.dist(centre, s.centre) > 1.15 * (radius + s.radius) for s in shapes):
                break
        else:
            continue
        colour = rng.choice([c for c in dataset.COLOURS if c != background])
        shapes.append(ForeignShape(rng.choice(dataset.SHAPES), colour, _shifted(rng, colour), centre, radius))
    return ForeignScene(tuple(shapes), background, _shifted(rng, background), (width, height), drawer)


def _star(cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    inner = 0.45 * r  # fatter than the generator's regular star
    return [(cx + (r if i % 2 == 0 else inner) * math.sin(math.pi * i / 5),
             cy - (r if i % 2 == 0 else inner) * math.cos(math.pi * i / 5)) for i in range(10)]


def _heart_parts(cx: float, cy: float, r: float) -> tuple[list[tuple[float, float]], list[tuple[float, float, float]]]:
    """A heart from primitives: two lobes (circles: x, y, radius) over a point-down triangle."""
    lobe = 0.5 * r
    lobes = [(cx - lobe, cy - 0.35 * r, lobe), (cx + lobe, cy - 0.35 * r, lobe)]
    triangle = [(cx - 0.97 * r, cy - 0.15 * r), (cx + 0.97 * r, cy - 0.15 * r), (cx, cy + r)]
    return triangle, lobes


def _draw_pil(scene: ForeignScene) -> Image.Image:
    image = Image.new("RGB", scene.size, scene.background_rgb)
    pen = ImageDraw.Draw(image)
    for s in scene.shapes:
        (cx, cy), r = s.centre, s.radius
        if s.kind == "circle":
            pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=s.rgb)
        elif s.kind == "square":
            side = r / math.sqrt(2) * 1.3
            pen.rectangle((cx - side, cy - side, cx + side, cy + side), fill=s.rgb)
        elif s.kind == "triangle":
            pen.regular_polygon((cx, cy, r), 3, fill=s.rgb)
        elif s.kind == "star":
            pen.polygon(_star(cx, cy, r), fill=s.rgb)
        else:
            triangle, lobes = _heart_parts(cx, cy, r)
            pen.polygon(triangle, fill=s.rgb)
            for x, y, lr in lobes:
                pen.ellipse((x - lr, y - lr, x + lr, y + lr), fill=s.rgb)
    return image


def _draw_opencv(scene: ForeignScene) -> Image.Image:
    width, height = scene.size
    canvas = np.empty((height, width, 3), np.uint8)
    canvas[:] = scene.background_rgb  # drawn in RGB order throughout, so no channel swap is needed
    line = cv2.LINE_AA
    for s in scene.shapes:
        (cx, cy), r, rgb = s.centre, s.radius, tuple(int(c) for c in s.rgb)
        if s.kind == "circle":
            cv2.circle(canvas, (round(cx), round(cy)), round(r), rgb, -1, line)
        elif s.kind == "square":
            side = r / math.sqrt(2) * 1.3
            cv2.rectangle(canvas, (round(cx - side), round(cy - side)), (round(cx + side), round(cy + side)), rgb, -1)
        elif s.kind in ("triangle", "star"):
            points = ([(cx + r * math.sin(2 * math.pi * i / 3), cy - r * math.cos(2 * math.pi * i / 3))
                       for i in range(3)] if s.kind == "triangle" else _star(cx, cy, r))
            cv2.fillPoly(canvas, [np.round(np.array(points)).astype(np.int32)], rgb, line)
        else:
            triangle, lobes = _heart_parts(cx, cy, r)
            cv2.fillPoly(canvas, [np.round(np.array(triangle)).astype(np.int32)], rgb, line)
            for x, y, lr in lobes:
                cv2.circle(canvas, (round(x), round(y)), round(lr), rgb, -1, line)
    return Image.fromarray(canvas)


def draw_foreign(scene: ForeignScene) -> Image.Image:
    return _draw_pil(scene) if scene.drawer == "pil" else _draw_opencv(scene)


def foreign_scenes(n: int, seed: int = FOREIGN_SEED) -> list[ForeignScene]:
    """`n` scenes, half drawn with PIL and half with OpenCV; the same arguments always give the same scenes."""
    rng = random.Random(seed)
    return [random_foreign_scene(rng, "pil" if i % 2 == 0 else "opencv") for i in range(n)]


# What a caption is scored on, each a share of the scenes: the pass mark ("shapes": every shape named by kind and
# colour, none invented), and its parts, which say where captions go wrong: the number of shapes, their colours and
# their kinds (each compared as a multiset, so a caption may get the colours right and the kinds wrong).
SCORES = ("shapes", "count", "colours", "kinds")


def caption_scores(caption: str, scene: ForeignScene) -> dict[str, bool]:
    """Whether the caption names exactly the scene's shapes (kind and colour), and the parts of that: their number,
    their colours, their kinds. A caption outside the grammar scores nothing."""
    parsed = dataset.parse_caption(caption)
    if parsed is None:
        return dict.fromkeys(SCORES, False)
    got, want = parsed.shapes, scene.shapes

    def same(*fields: str) -> bool:
        key = attrgetter(*fields)
        return Counter(map(key, got)) == Counter(map(key, want))
    return {"shapes": same("kind", "colour"), "count": len(got) == len(want), "colours": same("colour"),
            "kinds": same("kind")}


def foreign_scores(folder: Path | str, n: int, seed: int = FOREIGN_SEED) -> dict[str, float]:
    """The share of `n` foreign scenes whose greedy caption (through the engine) passes each of SCORES."""
    from a3b_core.runtime.loader import load_model
    from .train import caption_files
    scenes = foreign_scenes(n, seed)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, scene in enumerate(scenes):
            paths.append(Path(tmp) / f"foreign_{i:04d}.png")
            draw_foreign(scene).save(paths[-1])
        captions = caption_files(load_model(folder), paths)
    scored = [caption_scores(c, s) for c, s in zip(captions, scenes)]
    return {name: sum(s[name] for s in scored) / n for name in SCORES}


def main(argv: list[str] | None = None) -> None:
    from .train import DEMO_DIR
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=240)
    parser.add_argument("--seed", type=int, default=FOREIGN_SEED)
    parser.add_argument("--model", type=Path, default=DEMO_DIR)
    args = parser.parse_args(argv)
    scores = foreign_scores(args.model, args.n, args.seed)
    print(f"{args.model.name}: {scores['shapes']:.3f} of {args.n} foreign scenes named right (shape kinds and "
          f"colours); right number of shapes {scores['count']:.3f}, colours {scores['colours']:.3f}, "
          f"kinds {scores['kinds']:.3f}")


if __name__ == "__main__":
    main()
