"""The pixel-art pictures shipped with the workflows are exactly the generator scenes whose captions the tests expect;
the shipped clip is the generator's red circle."""
import random

import numpy as np
from PIL import Image

from a3b_core.demo.dataset import draw, parse_caption
from a3b_core.video import read_video
from tests.integration import video_inputs
from tests.integration.pixel_art_inputs import INPUTS, SCENES, expected_captions


def test_shipped_pixel_art_is_the_generator_output():
    for index, (name, scene) in enumerate(SCENES.items()):
        shipped = np.asarray(Image.open(INPUTS / name).convert("RGB"))
        assert np.array_equal(shipped, np.asarray(draw(scene, random.Random(index)))), name


def test_expected_captions_follow_the_demo_grammar():
    for name, caption in expected_captions().items():
        assert parse_caption(caption) == SCENES[name]


def test_shipped_clip_is_the_generated_circle():
    decoded = read_video(video_inputs.CLIP)
    assert decoded.frame_rate == video_inputs.FRAME_RATE
    drawn = np.asarray(video_inputs.frames(), dtype=np.float32)
    assert decoded.frames.shape == drawn.shape
    assert np.abs(decoded.frames.numpy().astype(np.float32) - drawn).mean() < 2  # VP9 is lossy at the circle's edge
    centre_column = [int(np.argmax(frame[..., 1].min(axis=0) < 128)) for frame in decoded.frames.numpy()]
    assert centre_column == sorted(centre_column) and centre_column[-1] > centre_column[0]  # it moves left to right
