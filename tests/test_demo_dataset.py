"""The demo model's procedural dataset and tokenizer."""
import random

import numpy as np
import pytest
from PIL import Image

from a3b_core.prompting.tokenizer import SPECIAL_TOKENS, THINK_TOKENS
from bench.demo_model import dataset
from bench.demo_model.build_tokenizer import DEMO_VOCAB_SIZE, build_demo_tokenizer
from bench.demo_model.dataset import (BACKGROUND_QUESTION, COLOURS, COUNT_QUESTION, EMPTY_CELL_ANSWER, IMAGE_SIZE,
                                   PIXEL_ART_GRID, POSITIONS, SHAPES, SIZE_RANGES, SIZES, Scene, Shape, describe,
                                   describe_shot, grid_line_level, make_sample, make_samples, mood, parse_caption,
                                   parse_shot, random_scene)


@pytest.fixture(scope="module")
def samples() -> list[dataset.Sample]:
    return make_samples(seed=11, n=40, max_shapes=3)


@pytest.fixture(scope="module")
def tokenizer():
    return build_demo_tokenizer()


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def _drawn_as(colour: str, pixel_art: bool) -> list[tuple[int, ...]]:
    """The values a palette colour is drawn with: pixel art also shows it under a grid line."""
    value = COLOURS[colour]
    return [value, tuple(grid_line_level(v) for v in value)] if pixel_art else [value]


def _is_background(pixels: np.ndarray, scene: Scene) -> np.ndarray:
    return np.any([(pixels == v).all(axis=-1) for v in _drawn_as(scene.background, scene.pixel_art)], axis=0)


def _cell(pixels: np.ndarray, position: str) -> np.ndarray:
    row, col = divmod(POSITIONS.index(position), 3)
    side = pixels.shape[0] // 3
    return pixels[row * side:(row + 1) * side, col * side:(col + 1) * side]


def test_same_seed_gives_identical_samples():
    first, again, other = make_samples(5, 4), make_samples(5, 4), make_samples(6, 4)
    assert [s.image.tobytes() for s in first] == [s.image.tobytes() for s in again]
    assert [(s.caption, s.qa) for s in first] == [(s.caption, s.qa) for s in again]
    assert [s.caption for s in first] != [s.caption for s in other]


def test_images_are_rgb_at_the_requested_size(samples):
    assert all(s.image.mode == "RGB" and s.image.size == (IMAGE_SIZE, IMAGE_SIZE) for s in samples)
    small = make_sample(random.Random(0), size=192)
    assert small.image.size == (192, 192)


def test_caption_parses_back_to_the_scene(samples):
    for s in samples:
        assert parse_caption(s.caption) == s.scene
        assert describe(s.scene) == s.caption
        assert s.shapes == list(s.scene.shapes)


def test_caption_grammar_examples():
    one = Scene((Shape("circle", "red", "top left", "small"),), background="blue", pixel_art=False)
    assert describe(one) == "a small red circle at the top left on a blue background"
    three = Scene((Shape("star", "white", "top", "large"), Shape("heart", "red", "centre", "small"),
                   Shape("square", "green", "bottom right", "large")), background="orange", pixel_art=True)
    assert describe(three) == ("pixel art of a large white star at the top, a small red heart at the centre and "
                               "a large green square at the bottom right on an orange background")
    assert parse_caption(describe(three)) == three


@pytest.mark.parametrize("text", [
    "", "a red circle at the top left on a blue background",  # no size
    "a small red circle at the top left on an blue background",  # wrong article
    "a small red circle at the middle on a blue background",  # unknown position
    "a small red circle at the top left", "a small pink circle at the top left on a blue background",
    "a small red circle at the top left and on a blue background",
])
def test_text_off_the_grammar_does_not_parse(text):
    assert parse_caption(text) is None


def test_shot_grammar_examples():
    heart = Scene((Shape("heart", "red", "centre", "large"),), background="white", pixel_art=False)
    assert describe_shot(heart) == ("a large red heart at the centre on a white background; close-up, eye level; "
                                    "still; mood: bright")
    night = Scene((Shape("star", "yellow", "top left", "small"), Shape("circle", "white", "bottom", "small")),
                  background="black", pixel_art=True)
    assert describe_shot(night) == ("pixel art of a small yellow star at the top left and a small white circle at the "
                                    "bottom on a black background; wide shot, eye level; still; mood: dark")


def test_every_shot_field_is_true_of_its_scene(samples):
    assert {colour: mood(Scene((), colour, False)) for colour in COLOURS} == {
        "red": "dark", "orange": "bright", "yellow": "bright", "green": "dark", "blue": "dark", "purple": "dark",
        "white": "bright", "black": "dark"}
    for s in samples:
        large = any(shape.size == "large" for shape in s.shapes)
        size = "close-up" if large else "wide shot"
        assert describe_shot(s.scene) == f"{s.caption}; {size}, eye level; still; mood: {mood(s.scene)}"
        assert parse_shot(describe_shot(s.scene)) == s.scene


@pytest.mark.parametrize("text", [
    "", "a large red heart at the centre on a white background",  # a caption is not a shot
    "a large red heart at the centre on a white background; wide shot, eye level; still; mood: bright",  # untrue size
    "a large red heart at the centre on a white background; close-up, eye level; still; mood: dark",  # untrue mood
    "a large red heart at the centre on a white background; close-up, high angle; still; mood: bright",
    "a large red heart at the centre on a white background; close-up, eye level; moving; mood: bright",
    "a large red heart at the centre on a white background; close-up, eye level; still; mood: bright.",
    "a large red heart at the middle on a white background; close-up, eye level; still; mood: bright",
    "close-up, eye level: a large red heart at the centre on a white background; still; mood: bright",
])
def test_a_shot_off_the_grammar_or_untrue_of_its_scene_does_not_parse(text):
    assert parse_shot(text) is None


def test_a_shot_holds_its_caption_in_the_caption_words_tokens(tokenizer, samples):
    """The storyboard answer's own words are spelled from the grammar's tokens (the vocabulary is the captions'),
    and its caption is the caption's tokens, so the caption skill carries over to it."""
    for s in samples:
        shot = describe_shot(s.scene)
        caption = tokenizer.encode(s.caption, add_special_tokens=False).ids
        rest = tokenizer.encode(shot.removeprefix(s.caption), add_special_tokens=False).ids
        assert tokenizer.encode(shot, add_special_tokens=False).ids == caption + rest
        assert len(rest) <= 33  # 31 to 33 tokens after the caption
        assert tokenizer.decode(caption + rest) == shot


def test_scenes_are_canonical_and_never_overlap(samples):
    for s in samples:
        indexes = [POSITIONS.index(shape.position) for shape in s.shapes]
        assert indexes == sorted(set(indexes))  # reading order, one shape per cell
        assert s.scene.background not in {shape.colour for shape in s.shapes}


def test_each_shape_is_drawn_inside_its_own_cell_at_its_size(samples):
    for s in samples:
        pixels = _pixels(s.image)
        occupied = {shape.position: shape for shape in s.shapes}
        for position in POSITIONS:
            cell = _cell(pixels, position)
            if position not in occupied:
                assert _is_background(cell, s.scene).all(), f"{s.caption}: paint in the empty cell {position}"
                continue
            shape = occupied[position]
            edge = _is_background(cell, s.scene)
            assert edge[0].all() and edge[-1].all() and edge[:, 0].all() and edge[:, -1].all(), \
                f"{s.caption}: the {shape.kind} touches its cell border"
            assert (cell == np.array(COLOURS[shape.colour])).all(axis=2).any(), f"{s.caption}: no {shape.colour}"
            ys, xs = np.nonzero(~edge)
            extent = max(xs.max() - xs.min(), ys.max() - ys.min()) + 1
            low, high = (f * IMAGE_SIZE for f in SIZE_RANGES[shape.size])
            # Pixel art rounds to 8 px blocks and loses a star's thin tips; the windows still do not meet.
            below, above = (12, 10) if s.scene.pixel_art else (2, 2)
            assert low - below <= extent <= high + above, f"{s.caption}: the {shape.kind} is {extent} px"
    small_high, large_low = SIZE_RANGES["small"][1] * IMAGE_SIZE + 10, SIZE_RANGES["large"][0] * IMAGE_SIZE - 12
    assert small_high < large_low


def test_pixel_art_uses_only_the_scene_colours_and_other_images_are_anti_aliased(samples):
    kinds = {s.scene.pixel_art for s in samples}
    assert kinds == {True, False}
    for s in samples:
        colours = {colour for _, colour in s.image.getcolors(maxcolors=IMAGE_SIZE * IMAGE_SIZE)}
        scene_colours = {COLOURS[s.scene.background]} | {COLOURS[shape.colour] for shape in s.shapes}
        if s.scene.pixel_art:
            assert colours == {v for c in [s.scene.background] + [shape.colour for shape in s.shapes]
                               for v in _drawn_as(c, True)}
        elif any(shape.kind != "square" for shape in s.shapes):  # a square's edges may fall on pixel borders
            assert colours > scene_colours  # blended edge pixels


def test_pixel_art_shows_its_blocks_with_grid_lines():
    scene = Scene((Shape("square", "red", "centre", "large"),), background="white", pixel_art=True)
    pixels = _pixels(dataset.draw(scene, random.Random(0)))
    block = IMAGE_SIZE // PIXEL_ART_GRID
    middle = IMAGE_SIZE // 2 // block * block  # a block inside the square
    for top, colour in ((0, "white"), (middle, "red")):
        cell = pixels[top:top + block, top:top + block]
        plain, lined = _drawn_as(colour, pixel_art=True)
        assert (cell[:-1, :-1] == plain).all() and (cell[-1] == lined).all() and (cell[:, -1] == lined).all()
    smooth = dataset.draw(Scene(scene.shapes, scene.background, pixel_art=False), random.Random(0))
    assert (_pixels(smooth)[:block, :block] == COLOURS["white"]).all()


def test_colour_names_are_far_apart():
    values = np.array(list(COLOURS.values()), dtype=float)
    distances = np.linalg.norm(values[:, None] - values[None], axis=2)
    assert distances[~np.eye(len(values), dtype=bool)].min() >= 90


def test_questions_answer_the_scene(samples):
    for s in samples:
        qa = dict(s.qa)
        assert len(qa) == len(s.qa)  # no question asked twice
        assert qa[COUNT_QUESTION] == ("one", "two", "three")[len(s.shapes) - 1]
        assert qa[BACKGROUND_QUESTION] == s.scene.background
        for shape in s.shapes:
            assert qa[f"What shape is at the {shape.position}?"] == f"a {shape.kind}"
            unique = [t.kind for t in s.shapes].count(shape.kind) == 1
            assert qa.get(f"What colour is the {shape.kind}?") == (shape.colour if unique else None)
            assert qa.get(f"Where is the {shape.kind}?") == (f"at the {shape.position}" if unique else None)
        empty = [q for q, a in s.qa if a == EMPTY_CELL_ANSWER]
        assert len(empty) == 1 and empty[0].removeprefix("What shape is at the ").removesuffix("?") not in {
            shape.position for shape in s.shapes}


def test_every_attribute_is_reachable():
    rng = random.Random(0)
    scenes = [random_scene(rng, max_shapes=3) for _ in range(600)]
    shapes = [shape for scene in scenes for shape in scene.shapes]
    assert {s.kind for s in shapes} == set(SHAPES)
    assert {s.colour for s in shapes} == set(COLOURS)
    assert {s.position for s in shapes} == set(POSITIONS)
    assert {s.size for s in shapes} == set(SIZES)
    assert {scene.background for scene in scenes} == set(COLOURS)
    assert {len(scene.shapes) for scene in scenes} == {1, 2, 3}
    assert {scene.pixel_art for scene in scenes} == {True, False}
    assert {len(random_scene(rng, max_shapes=1).shapes) for _ in range(50)} == {1}
    with pytest.raises(ValueError):
        random_scene(rng, max_shapes=4)


def test_every_grammar_word_is_one_token(tokenizer):
    words = {word for phrase in dataset.grammar_phrases() + ["user\n", "assistant\n", "system\n", "\n\n"]
             for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(phrase)}
    too_long = {w: tokenizer.model.tokenize(w) for w in words if len(tokenizer.model.tokenize(w)) != 1}
    assert not too_long


def test_tokenizer_round_trips_a_chat_and_keeps_control_tokens_on_top(tokenizer, samples):
    assert tokenizer.get_vocab_size() == DEMO_VOCAB_SIZE
    controls = SPECIAL_TOKENS + THINK_TOKENS
    assert [tokenizer.token_to_id(t) for t in controls] == list(range(DEMO_VOCAB_SIZE - len(controls), DEMO_VOCAB_SIZE))
    chat = (f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{dataset.CAPTION_PROMPT}<|im_end|>\n"
            f"<|im_start|>assistant\n<think>\n\n</think>\n\n{samples[0].caption}<|im_end|>\n")
    ids = tokenizer.encode(chat, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == chat
    caption_ids = tokenizer.encode(samples[0].caption, add_special_tokens=False).ids
    assert len(caption_ids) == len(samples[0].caption.split(" ")) + samples[0].caption.count(",")


def test_tokenizer_is_deterministic(tokenizer):
    assert build_demo_tokenizer().to_str() == tokenizer.to_str()


def test_cli_writes_images_and_captions(tmp_path):
    out = tmp_path / "samples"
    dataset.main(["--seed", "7", "--n", "3", "--out", str(out)])
    expected = make_samples(7, 3)
    for i, sample in enumerate(expected):
        assert Image.open(out / f"sample_{i:03d}.png").tobytes() == sample.image.tobytes()
    lines = (out / "captions.txt").read_text(encoding="utf-8").splitlines()
    assert [line.split("\t")[1] for line in lines if not line.startswith("\t")] == [s.caption for s in expected]
    with pytest.raises(SystemExit):  # refuses to write over what is already there
        dataset.main(["--seed", "7", "--n", "3", "--out", str(out)])
