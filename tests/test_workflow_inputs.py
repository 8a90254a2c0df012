"""The pictures shipped with the workflows (pixel art, the multi-view scene, the storyboard panels) are exactly the
generator scenes whose captions or shots the tests expect; the shipped clip is the generated red circle."""
import random

import numpy as np
import pytest
from PIL import Image

from a3b_core.media.video import read_video
from bench.demo_model.dataset import draw, draw_scenes, parse_caption, parse_shot
from tests.integration import pixel_art_inputs, storyboard_inputs, video_inputs, view_inputs


@pytest.mark.parametrize("inputs, scenes, expected, parse", [
    (pixel_art_inputs, pixel_art_inputs.SCENES, pixel_art_inputs.expected_captions, parse_caption),
    (view_inputs, view_inputs.VIEWS, view_inputs.expected_captions, parse_caption),
    (storyboard_inputs, storyboard_inputs.PANELS, storyboard_inputs.expected_shots, parse_shot)],
    ids=["pixel art", "views", "storyboard"])
def test_shipped_pictures_are_the_generator_output(inputs, scenes, expected, parse):
    for index, (name, scene) in enumerate(scenes.items()):
        shipped = np.asarray(Image.open(inputs.INPUTS / name).convert("RGB"))
        assert np.array_equal(shipped, np.asarray(draw(scene, random.Random(index)))), name
    for name, answer in expected().items():
        assert parse(answer) == scenes[name]


@pytest.mark.parametrize("inputs, scenes", [
    (pixel_art_inputs, pixel_art_inputs.SCENES), (view_inputs, view_inputs.VIEWS),
    (storyboard_inputs, storyboard_inputs.PANELS)], ids=["pixel art", "views", "storyboard"])
def test_redrawing_writes_the_shipped_pictures(inputs, scenes, tmp_path):
    """What `python -m tests.integration.<inputs>` runs: draw_scenes writes every picture as shipped."""
    draw_scenes(scenes, tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(scenes)
    for name in scenes:
        drawn, shipped = (np.asarray(Image.open(folder / name).convert("RGB")) for folder in (tmp_path, inputs.INPUTS))
        assert np.array_equal(drawn, shipped), name


def test_shipped_clip_is_the_generated_circle():
    decoded = read_video(video_inputs.CLIP)
    assert decoded.frame_rate == video_inputs.FRAME_RATE
    drawn = np.asarray(video_inputs.frames(), dtype=np.float32)
    assert decoded.frames.shape == drawn.shape
    assert np.abs(decoded.frames.numpy().astype(np.float32) - drawn).mean() < 2  # VP9 is lossy at the circle's edge
    centre_column = [int(np.argmax(frame[..., 1].min(axis=0) < 128)) for frame in decoded.frames.numpy()]
    assert centre_column == sorted(centre_column) and centre_column[-1] > centre_column[0]  # it moves left to right
