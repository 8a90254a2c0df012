"""Seeded procedural images of coloured shapes, with canonical captions and short questions and answers.

The data the embedded "a3b-demo" model is trained on. A scene is a plain background holding one or more shapes, each
in its own cell of a 3x3 grid, so shapes never overlap and every shape has a one-word-or-two position. Captions follow
one fixed grammar (shapes in reading order, every attribute always named), so a caption is a function of the scene
and `parse_caption` turns it back into the scene:

    caption    := ["pixel art of "] shapes " on " article colour " background"
    shapes     := shape | shape " and " shape | shape ", " shape " and " shape
    shape      := "a " size " " colour " " kind " at the " position

for example "a small red circle at the top left and a large green star at the centre on a blue background".

The storyboard request (`STORYBOARD_PROMPT`) is answered with the scene as one storyboard shot, in the order the
request names the fields, the caption first:

    shot       := caption "; " shot_size ", eye level; still; mood: " mood

for example "a large red heart at the centre on a white background; close-up, eye level; still; mood: bright". Every
field is true of the picture: the shot size is "close-up" when the largest shape is large and "wide shot" when every
shape is small; the camera angle is always "eye level" (a flat drawing is seen straight on); the action is "still" (one
picture shows no motion); the mood is "bright" on a background whose luma (Rec. 601) is at least 128 (white, yellow,
orange) and "dark" on the others (green, red, blue, purple, black). Both follow from words of the caption before them,
which a tiny model reads more easily than the picture. `parse_shot` turns a shot back into the scene.

Two shapes at most by default: the demo model (a tiny vision tower trained for minutes on a CPU) has to bind colour,
kind, size and position per shape, and every extra shape multiplies what it must learn. A tiny model learns the
grammar and the background colour within a few hundred steps, the per-shape attributes much later, so training can
start with `max_shapes=1`; three shapes are available (`max_shapes=3`) for longer runs.
"""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

IMAGE_SIZE = 384  # the engine's default encode size: 24x24 patches of 16, 144 language-model tokens
MAX_SHAPES = 2

# Far apart in RGB (at least 90 apart pairwise) so that a colour name never depends on a judgement call. Blue and
# purple are close enough that blue stored as ProPhoto RGB values and read as sRGB is nearer purple: only colour
# management names it right.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "orange": (255, 140, 0),
    "yellow": (255, 230, 0),
    "green": (20, 170, 40),
    "blue": (20, 60, 230),
    "purple": (120, 40, 210),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}
SHAPES = ("circle", "square", "triangle", "star", "heart")
POSITIONS = ("top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right")
SIZES = ("small", "large")
NUMBER_WORDS = ("one", "two", "three")

# Outer diameter of a shape as a fraction of the image side. A grid cell is 1/3 of the side, so a large shape still
# fits its cell with CELL_MARGIN to spare; the smallest shape is 65 px at 384, four patches across.
SIZE_RANGES = {"small": (0.17, 0.19), "large": (0.26, 0.29)}
# Fraction of the side kept free at each cell border, so neighbouring shapes never touch: 7.7 px at 384, more than
# the 6 px by which pixel art can overshoot (it paints every 8 px block the shape covers by half, and PIL's polygon
# fill adds a quarter block).
CELL_MARGIN = 0.02
SUPERSAMPLE = 4  # edges are anti-aliased by drawing 4x finer and averaging 4x4 blocks
# Pixel art is drawn at 48x48: 8 px blocks at 384, four to a side of the demo model's 32 px patches, with a grid line
# between blocks, as a pixel editor shows a sprite zoomed in. Hard stair-step edges alone are a texture that a tiny
# ViT over 32 px patches does not learn to tell from anti-aliased ones in minutes; lines at a fixed place in every
# patch it learns at once.
PIXEL_ART_GRID = 48
GRID_LINE_GREY, GRID_LINE_MIX = 128, 0.3
PIXEL_ART_RATE = 0.25

# The prompts the model is trained on; the caption answers CAPTION_PROMPT.
CAPTION_PROMPT = "Describe the image."
COUNT_QUESTION = "How many shapes are there?"
BACKGROUND_QUESTION = "What colour is the background?"
SHAPE_AT_QUESTION = "What shape is at the {position}?"
COLOUR_OF_QUESTION = "What colour is the {kind}?"
POSITION_OF_QUESTION = "Where is the {kind}?"
EMPTY_CELL_ANSWER = "nothing"
STORYBOARD_PROMPT = "Describe this storyboard panel as one shot: subject, shot size, camera angle, action and mood."
BRIGHT_LUMA = 128  # a background at least this bright (Rec. 601 luma of its palette value) sets a bright mood


@dataclass(frozen=True)
class Shape:
    kind: str  # one of SHAPES
    colour: str  # a key of COLOURS
    position: str  # one of POSITIONS
    size: str  # one of SIZES


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]  # in reading order of their positions
    background: str  # a key of COLOURS, different from every shape's colour
    pixel_art: bool


@dataclass
class Sample:
    image: Image.Image
    caption: str
    qa: list[tuple[str, str]]  # (question, answer) pairs about the same image
    scene: Scene

    @property
    def shapes(self) -> list[Shape]:
        return list(self.scene.shapes)


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _count_word(n: int) -> str:
    return NUMBER_WORDS[n - 1]


def describe_shape(shape: Shape) -> str:
    return f"a {shape.size} {shape.colour} {shape.kind} at the {shape.position}"


def describe(scene: Scene) -> str:
    """The one canonical caption of a scene."""
    phrases = [describe_shape(s) for s in scene.shapes]
    listed = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    text = f"{listed} on {article(scene.background)} {scene.background} background"
    return "pixel art of " + text if scene.pixel_art else text


def _parse_shape(phrase: str) -> Shape | None:
    head, sep, position = phrase.rpartition(" at the ")
    words = head.split(" ")
    if (not sep or position not in POSITIONS or len(words) != 4 or words[0] != "a" or words[1] not in SIZES
            or words[2] not in COLOURS or words[3] not in SHAPES):
        return None
    return Shape(kind=words[3], colour=words[2], position=position, size=words[1])


def parse_caption(text: str) -> Scene | None:
    """The scene a caption describes, or None when the text does not follow the grammar (e.g. a model's mistake)."""
    pixel_art = text.startswith("pixel art of ")
    if pixel_art:
        text = text[len("pixel art of "):]
    listed, sep, background_phrase = text.rpartition(" on ")
    bg_words = background_phrase.split(" ")
    if (not sep or len(bg_words) != 3 or bg_words[1] not in COLOURS
            or bg_words[0] != article(bg_words[1]) or bg_words[2] != "background"):
        return None
    head, sep, last = listed.rpartition(" and ")
    phrases = (head.split(", ") + [last]) if sep else [listed]
    shapes = [_parse_shape(p) for p in phrases]
    if any(s is None for s in shapes):
        return None
    return Scene(shapes=tuple(shapes), background=bg_words[1], pixel_art=pixel_art)


def shot_size(scene: Scene) -> str:
    return "close-up" if any(s.size == "large" for s in scene.shapes) else "wide shot"


def mood(scene: Scene) -> str:
    red, green, blue = COLOURS[scene.background]
    return "bright" if 0.299 * red + 0.587 * green + 0.114 * blue >= BRIGHT_LUMA else "dark"


def describe_shot(scene: Scene) -> str:
    """The one canonical answer to STORYBOARD_PROMPT about a scene."""
    return f"{describe(scene)}; {shot_size(scene)}, eye level; still; mood: {mood(scene)}"


def parse_shot(text: str) -> Scene | None:
    """The scene a shot describes, or None when the text does not follow the shot grammar or a field is not true of
    the scene its caption describes."""
    scene = parse_caption(text.partition("; ")[0])
    return scene if scene is not None and describe_shot(scene) == text else None


def random_scene(rng: random.Random, max_shapes: int = MAX_SHAPES) -> Scene:
    if not 1 <= max_shapes <= len(NUMBER_WORDS):
        raise ValueError(f"max_shapes={max_shapes}: expected 1 to {len(NUMBER_WORDS)}")
    count = rng.randint(1, max_shapes)
    background = rng.choice(list(COLOURS))
    shape_colours = [c for c in COLOURS if c != background]
    cells = sorted(rng.sample(range(len(POSITIONS)), count))  # sorted: reading order makes the caption canonical
    shapes = tuple(Shape(kind=rng.choice(SHAPES), colour=rng.choice(shape_colours), position=POSITIONS[cell],
                         size=rng.choice(SIZES)) for cell in cells)
    return Scene(shapes=shapes, background=background, pixel_art=rng.random() < PIXEL_ART_RATE)


def questions(scene: Scene, rng: random.Random) -> list[tuple[str, str]]:
    """Every question the grammar asks about the scene, with its answer; one empty cell is asked about too."""
    qa = [(COUNT_QUESTION, _count_word(len(scene.shapes))), (BACKGROUND_QUESTION, scene.background)]
    qa += [(SHAPE_AT_QUESTION.format(position=s.position), f"a {s.kind}") for s in scene.shapes]
    taken = {s.position for s in scene.shapes}
    empty = rng.choice([p for p in POSITIONS if p not in taken])
    qa.append((SHAPE_AT_QUESTION.format(position=empty), EMPTY_CELL_ANSWER))
    kinds = [s.kind for s in scene.shapes]
    for s in scene.shapes:
        if kinds.count(s.kind) == 1:  # "the circle" must name one shape
            qa.append((COLOUR_OF_QUESTION.format(kind=s.kind), s.colour))
            qa.append((POSITION_OF_QUESTION.format(kind=s.kind), f"at the {s.position}"))
    return qa


def _unit_outline(kind: str) -> list[tuple[float, float]]:
    """The shape's outline as a polygon, in any scale; y grows downwards."""
    if kind == "circle":
        return [(math.cos(2 * math.pi * i / 64), math.sin(2 * math.pi * i / 64)) for i in range(64)]
    if kind == "square":
        return [(-1, -1), (1, -1), (1, 1), (-1, 1)]
    if kind == "triangle":  # equilateral, point up
        return [(0, -1), (1, math.sqrt(3) - 1), (-1, math.sqrt(3) - 1)]
    if kind == "star":  # five points, one up; inner radius of a regular star
        inner = math.sin(math.radians(18)) / math.sin(math.radians(126))
        return [((1 if i % 2 == 0 else inner) * math.sin(math.pi * i / 5),
                 -(1 if i % 2 == 0 else inner) * math.cos(math.pi * i / 5)) for i in range(10)]
    if kind == "heart":  # the classic parametric heart curve
        ts = [2 * math.pi * i / 96 for i in range(96)]
        return [(16 * math.sin(t) ** 3, -(13 * math.cos(t) - 5 * math.cos(2 * t) - 2 * math.cos(3 * t) - math.cos(4 * t)))
                for t in ts]
    raise ValueError(f"unknown shape {kind!r}")


def _fit(points: list[tuple[float, float]], cx: float, cy: float, diameter: float) -> list[tuple[float, float]]:
    """Scales and moves a polygon so its bounding box is centred on (cx, cy), its longer side `diameter` long."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    scale = diameter / max(max(xs) - min(xs), max(ys) - min(ys))
    mx, my = (max(xs) + min(xs)) / 2, (max(ys) + min(ys)) / 2
    return [(cx + (x - mx) * scale, cy + (y - my) * scale) for x, y in points]


def draw(scene: Scene, rng: random.Random, size: int = IMAGE_SIZE) -> Image.Image:
    """Renders a scene as a `size` x `size` RGB image; `rng` jitters each shape's size and place inside its cell."""
    grid = PIXEL_ART_GRID if scene.pixel_art else size
    canvas = Image.new("RGB", (grid, grid), COLOURS[scene.background])
    for shape in scene.shapes:
        diameter = rng.uniform(*SIZE_RANGES[shape.size])
        slack = max(0.0, (1 / 3 - diameter) / 2 - CELL_MARGIN)  # how far the shape may move and stay in its cell
        row, col = divmod(POSITIONS.index(shape.position), 3)
        cx = (col + 0.5) / 3 + rng.uniform(-slack, slack)
        cy = (row + 0.5) / 3 + rng.uniform(-slack, slack)
        paint(canvas, shape.kind, shape.colour, cx, cy, diameter, hard_edges=scene.pixel_art)
    if not scene.pixel_art:
        return canvas
    canvas = canvas.resize((size, size), Image.Resampling.NEAREST)
    canvas.paste(canvas.point(grid_line_level), mask=_grid_lines(size, size // grid))
    return canvas


def paint(canvas: Image.Image, kind: str, colour: str, cx: float, cy: float, diameter: float,
          hard_edges: bool = False) -> None:
    """Paints one shape onto a square canvas, centred at (cx, cy) and `diameter` across, all as fractions of the side.
    The shape's coverage of each pixel is measured on a 4x finer grid: soft edges, or with `hard_edges` (pixel art)
    the pixels at least half covered, so that it keeps hard edges, few colours and its true size. Only the pixels
    around the shape are measured (a whole 4x canvas per shape made data the training bottleneck)."""
    grid = canvas.width
    left, top = (max(0, math.floor((c - diameter / 2) * grid) - 1) for c in (cx, cy))
    right, bottom = (min(grid, math.ceil((c + diameter / 2) * grid) + 1) for c in (cx, cy))
    fine = grid * SUPERSAMPLE
    outline = _fit(_unit_outline(kind), cx * fine, cy * fine, diameter * fine)
    mask = Image.new("L", ((right - left) * SUPERSAMPLE, (bottom - top) * SUPERSAMPLE), 0)
    ImageDraw.Draw(mask).polygon([(x - left * SUPERSAMPLE, y - top * SUPERSAMPLE) for x, y in outline], fill=255)
    mask = mask.resize((right - left, bottom - top), Image.Resampling.BOX)
    if hard_edges:
        mask = mask.point(lambda coverage: 255 if coverage >= 128 else 0)
    canvas.paste(COLOURS[colour], (left, top), mask=mask)


def grid_line_level(level: int) -> int:
    """A channel level as a grid line shows it: 30% of the way to mid grey."""
    return round(level + (GRID_LINE_GREY - level) * GRID_LINE_MIX)


def _grid_lines(size: int, block: int) -> Image.Image:
    """A mask of the last pixel row and column of every `block` x `block` block."""
    mask = Image.new("L", (size, size), 0)
    pen = ImageDraw.Draw(mask)
    for at in range(block - 1, size, block):
        pen.line([(at, 0), (at, size - 1)], fill=255)
        pen.line([(0, at), (size - 1, at)], fill=255)
    return mask


def draw_scenes(scenes: dict[str, Scene], folder: Path) -> None:
    """Draws each scene into `folder` under its file name (PNG), the i-th with random.Random(i): the pictures the
    shipped workflows read, which tests draw again the same way to compare."""
    for index, (name, scene) in enumerate(scenes.items()):
        draw(scene, random.Random(index)).save(folder / name, optimize=True)


def make_sample(rng: random.Random, size: int = IMAGE_SIZE, max_shapes: int = MAX_SHAPES) -> Sample:
    scene = random_scene(rng, max_shapes)
    image = draw(scene, rng, size)
    return Sample(image=image, caption=describe(scene), qa=questions(scene, rng), scene=scene)


def make_samples(seed: int, n: int, size: int = IMAGE_SIZE, max_shapes: int = MAX_SHAPES) -> list[Sample]:
    """`n` samples; the same arguments always give identical images and text."""
    rng = random.Random(seed)
    return [make_sample(rng, size, max_shapes) for _ in range(n)]


def grammar_phrases() -> list[str]:
    """Phrases that together hold every word the generator can emit, each in the context it appears in (a word
    that can start a caption or answer appears once at the start): a tokenizer trained on them covers all captions."""
    phrases = [describe_shape(Shape(kind, colour, position, size))
               for kind in SHAPES for colour in COLOURS for position in POSITIONS for size in SIZES]
    phrases += [f"on {article(c)} {c} background" for c in COLOURS]
    some_shapes = tuple(Shape(SHAPES[0], colour, POSITIONS[0], SIZES[0]) for colour in list(COLOURS)[:3])
    phrases.append(describe(Scene(some_shapes, background="blue", pixel_art=True)))  # the joins and the prefix
    phrases += [CAPTION_PROMPT, COUNT_QUESTION, BACKGROUND_QUESTION, EMPTY_CELL_ANSWER]
    phrases += [SHAPE_AT_QUESTION.format(position=p) for p in POSITIONS]
    phrases += [f"at the {p}" for p in POSITIONS]
    phrases += [COLOUR_OF_QUESTION.format(kind=k) for k in SHAPES] + [POSITION_OF_QUESTION.format(kind=k) for k in SHAPES]
    phrases += [f"a {k}" for k in SHAPES] + list(COLOURS) + list(NUMBER_WORDS)
    return phrases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write demo samples (PNG images and captions.txt) to look at.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--size", type=int, default=IMAGE_SIZE)
    parser.add_argument("--max-shapes", type=int, default=MAX_SHAPES, choices=range(1, len(NUMBER_WORDS) + 1))
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    args = parser.parse_args(argv)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out {args.out}: expected a new or empty folder, so that nothing is overwritten; "
                     "pick another path or empty this one")
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, sample in enumerate(make_samples(args.seed, args.n, args.size, args.max_shapes)):
        name = f"sample_{i:03d}.png"
        sample.image.save(args.out / name)
        lines.append(f"{name}\t{sample.caption}")
        lines += [f"\t{q} -> {a}" for q, a in sample.qa]
    (args.out / "captions.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.n} samples to {args.out}")


if __name__ == "__main__":
    main()
