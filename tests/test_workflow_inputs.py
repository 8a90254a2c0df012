"""The pixel-art pictures shipped with the workflows are exactly the generator scenes whose captions the tests expect."""
import random

import numpy as np
from PIL import Image

from a3b_core.demo.dataset import draw, parse_caption
from tests.integration.pixel_art_inputs import INPUTS, SCENES, expected_captions


def test_shipped_pixel_art_is_the_generator_output():
    for index, (name, scene) in enumerate(SCENES.items()):
        shipped = np.asarray(Image.open(INPUTS / name).convert("RGB"))
        assert np.array_equal(shipped, np.asarray(draw(scene, random.Random(index)))), name


def test_expected_captions_follow_the_demo_grammar():
    for name, caption in expected_captions().items():
        assert parse_caption(caption) == SCENES[name]
