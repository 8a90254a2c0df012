"""Seeded clips of one shape moving across a plain background, with their captions: the demo model's video skill.

A clip is 12 frames at 6 frames per second (2 seconds) of one shape of the still scenes' kinds, colours and sizes,
painted by `dataset.paint`, whose centre moves evenly from one third of the frame to the opposite third, left to
right, right to left, top to bottom or bottom to top, at a free place across the motion. The motion runs from frame
`REST_FRAMES` to frame 11 - `REST_FRAMES`, the shape still before and after it, so that the first and last frame groups
the model reads are still pictures of where it starts and ends, which the still scenes taught it to place (a moving
shape shows twice in a frame group, once in each of its two frames). Its caption:

    caption := "a " size " " colour " " kind " moving from the " side " to the " side " on " article colour
               " background"

for example "a large red circle moving from the left to the right on a white background". The model reads a clip
as the video workflow samples it (`SAMPLE_FPS`, `MAX_FRAMES`): 8 of the 12 frames, in 4 frame groups.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image

from . import dataset

VIDEO_PROMPT = "Describe the video."
CLIP_FRAMES, CLIP_FRAME_RATE = 12, 6.0
SAMPLE_FPS, MAX_FRAMES = 4.0, 16  # A3B Video Encode's settings in the video workflow
MOTIONS = (("left", "right"), ("right", "left"), ("top", "bottom"), ("bottom", "top"))
EDGE_MARGIN = 0.03  # the shape stays this far (a fraction of the side) inside the frame
REST_FRAMES = 3


@dataclass(frozen=True)
class Clip:
    kind: str  # one of dataset.SHAPES
    colour: str  # a key of dataset.COLOURS
    size: str  # one of dataset.SIZES
    start: str  # the side the shape starts at: a first word of MOTIONS
    end: str  # the side it moves to
    background: str  # a key of dataset.COLOURS, not the shape's colour


def describe_clip(clip: Clip) -> str:
    """The one canonical caption of a clip."""
    return (f"a {clip.size} {clip.colour} {clip.kind} moving from the {clip.start} to the {clip.end} on "
            f"{dataset.article(clip.background)} {clip.background} background")


def random_clip(rng: random.Random) -> Clip:
    background = rng.choice(list(dataset.COLOURS))
    start, end = rng.choice(MOTIONS)
    return Clip(kind=rng.choice(dataset.SHAPES), colour=rng.choice([c for c in dataset.COLOURS if c != background]),
                size=rng.choice(dataset.SIZES), start=start, end=end, background=background)


def draw_clip(clip: Clip, rng: random.Random, size: int = dataset.IMAGE_SIZE,
              frames: int = CLIP_FRAMES) -> np.ndarray:
    """[frames, size, size, 3] uint8. The shape's centre starts in the third of the frame at `clip.start` and ends in
    the opposite third, moving from frame `REST_FRAMES` to frame `frames` - 1 - `REST_FRAMES`; across the motion it
    keeps one place, anywhere that leaves it inside the frame."""
    diameter = rng.uniform(*dataset.SIZE_RANGES[clip.size])
    inner = diameter / 2 + EDGE_MARGIN  # the closest a centre comes to an edge
    first, last = rng.uniform(inner, 1 / 3), rng.uniform(2 / 3, 1 - inner)
    if clip.start in ("right", "bottom"):
        first, last = 1 - first, 1 - last
    across = rng.uniform(inner, 1 - inner)
    out = np.empty((frames, size, size, 3), dtype=np.uint8)
    for index in range(frames):
        progress = min(max((index - REST_FRAMES) / (frames - 1 - 2 * REST_FRAMES), 0.0), 1.0)
        along = first + (last - first) * progress
        cx, cy = (along, across) if clip.start in ("left", "right") else (across, along)
        canvas = Image.new("RGB", (size, size), dataset.COLOURS[clip.background])
        dataset.paint(canvas, clip.kind, clip.colour, cx, cy, diameter)
        out[index] = np.asarray(canvas)
    return out


def seeded_clip(seed: int, index: int) -> tuple[Clip, np.ndarray]:
    """Clip `index` of the stream `seed` (training, validation and held-out clips alike), with its frames."""
    rng = random.Random(f"{seed}-clip-{index}")
    clip = random_clip(rng)
    return clip, draw_clip(clip, rng)
