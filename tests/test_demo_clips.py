"""The demo model's clips: seeded, drawn as their captions say (one shape of the named colour moving from one third of
the frame to the opposite one), and trained on exactly the prompt the engine makes of the same clip."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from a3b_core.prompting.tokenizer import Tokenizer
from a3b_core.runtime.loader import load_model
from bench.demo_model import clips, dataset, train
from bench.demo_model.build_tokenizer import build_demo_tokenizer


def drawn(seed: int) -> tuple[clips.Clip, np.ndarray]:
    rng = random.Random(seed)
    clip = clips.random_clip(rng)
    return clip, clips.draw_clip(clip, rng)


def test_same_seed_gives_the_same_clip():
    (first, frames), (again, frames_again) = drawn(5), drawn(5)
    assert first == again and np.array_equal(frames, frames_again)
    assert frames.shape == (clips.CLIP_FRAMES, dataset.IMAGE_SIZE, dataset.IMAGE_SIZE, 3)


def test_caption_names_the_clip():
    clip = clips.Clip("circle", "red", "large", "left", "right", "white")
    assert clips.describe_clip(clip) == "a large red circle moving from the left to the right on a white background"
    orange = clips.Clip("star", "blue", "small", "bottom", "top", "orange")
    assert clips.describe_clip(orange).endswith("moving from the bottom to the top on an orange background")


@pytest.mark.parametrize("seed", range(12))
def test_the_shape_moves_from_its_start_third_to_the_opposite_one(seed):
    clip, frames = drawn(seed)
    horizontal = clip.start in ("left", "right")
    centres = []
    for frame in frames:
        shape = np.all(frame == dataset.COLOURS[clip.colour], axis=-1)
        assert shape.any() and np.all(frame[0, 0] == dataset.COLOURS[clip.background])
        along = np.nonzero(shape)[1 if horizontal else 0]
        centres.append((along.min() + along.max() + 1) / 2 / dataset.IMAGE_SIZE)  # the shape's box, as painted
    if clip.start in ("right", "bottom"):
        centres = [1 - c for c in centres]
    assert centres[0] < 1 / 3 + 0.01 and centres[-1] > 2 / 3 - 0.01
    rest = clips.REST_FRAMES
    assert len(set(centres[:rest + 1])) == len(set(centres[-rest - 1:])) == 1  # still before and after the motion
    moving = centres[rest:len(centres) - rest]
    assert all(b > a for a, b in zip(moving, moving[1:]))


def test_every_direction_colour_and_kind_is_drawn():
    seen = [clips.random_clip(random.Random(seed)) for seed in range(200)]
    assert {(c.start, c.end) for c in seen} == set(clips.MOTIONS)
    assert {c.kind for c in seen} == set(dataset.SHAPES) and {c.size for c in seen} == set(dataset.SIZES)
    assert all(c.colour != c.background for c in seen)


def test_training_sees_the_prompt_the_engine_makes_of_the_clip():
    tokenizer = Tokenizer(build_demo_tokenizer())
    config = train.demo_config(tokenizer)
    item = train.ClipData(config, seed=3, length=1)[0]
    clip, frames = clips.seeded_clip(3, 0)
    model = load_model("a3b-demo")
    video = model.encode_video(torch.from_numpy(frames), frame_rate=clips.CLIP_FRAME_RATE, fps=clips.SAMPLE_FPS,
                               max_frames=clips.MAX_FRAMES)
    prompt = model.build_prompt(user=clips.VIDEO_PROMPT, images=video)
    ids, labels = item["sequence"]
    answer = tokenizer.encode(clips.describe_clip(clip)) + [tokenizer.token_id("<|im_end|>")]
    assert ids == list(prompt.input_ids) + answer
    assert [label for label in labels if label != train.IGNORE] == answer
    assert item["grid"] == video.grids[0] == (4, 12, 12)
