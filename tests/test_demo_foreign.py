"""The foreign test scenes: drawn by PIL's and OpenCV's primitives, outside the training generator's sizes, places
and colours; a caption passes only when it names exactly the scene's shapes."""
import numpy as np
import pytest

from bench.demo_model import dataset
from bench.demo_model.foreign import DIAMETERS, SCORES, caption_scores, draw_foreign, foreign_scenes, main


@pytest.fixture(scope="module")
def scenes():
    return foreign_scenes(40)


def test_same_arguments_same_scenes(scenes):
    again = foreign_scenes(40)
    assert again == scenes
    assert all(np.array_equal(np.asarray(draw_foreign(a)), np.asarray(draw_foreign(b)))
               for a, b in zip(scenes[:6], again[:6]))
    assert {s.drawer for s in scenes} == {"pil", "opencv"}


def test_scenes_leave_the_generator_s_ranges(scenes):
    for scene in scenes:
        assert scene.background_rgb != dataset.COLOURS[scene.background]
        for shape in scene.shapes:
            assert shape.colour != scene.background and shape.rgb != dataset.COLOURS[shape.colour]
            fraction = 2 * shape.radius / min(scene.size)
            assert any(low <= fraction <= high for low, high in DIAMETERS)
            assert not any(low <= fraction <= high for low, high in dataset.SIZE_RANGES.values())
    assert any(scene.size != (dataset.IMAGE_SIZE, dataset.IMAGE_SIZE) for scene in scenes)


def test_each_shape_is_painted_at_its_centre_in_its_colour(scenes):
    for scene in scenes:
        pixels = np.asarray(draw_foreign(scene))
        assert pixels.shape == (scene.size[1], scene.size[0], 3)
        for shape in scene.shapes:
            x, y = (round(c) for c in shape.centre)
            assert tuple(pixels[y, x]) == shape.rgb, (scene, shape)


def names_shapes(caption, scene):
    return caption_scores(caption, scene)["shapes"]


def test_a_caption_passes_only_with_exactly_the_scene_s_shapes(scenes):
    scene = next(s for s in scenes if len(s.shapes) == 2)
    first, second = scene.shapes
    phrase = "a small {} {} at the top"
    other_kind = next(k for k in dataset.SHAPES if k != first.kind)
    right = f"{phrase.format(first.colour, first.kind)} and {phrase.format(second.colour, second.kind)} on a " \
            f"{scene.background} background"
    assert names_shapes(right, scene)
    assert not names_shapes(f"{phrase.format(first.colour, first.kind)} on a {scene.background} background", scene)
    assert not names_shapes(right.replace(f"{first.colour} {first.kind}", f"{first.colour} {other_kind}", 1), scene)
    invented = f"{phrase.format(first.colour, first.kind)}, {phrase.format(second.colour, second.kind)} and " \
               f"{phrase.format(second.colour, second.kind)} on a {scene.background} background"
    assert not names_shapes(invented, scene)
    assert not names_shapes("a red circle", scene)


def test_the_parts_of_the_score_say_what_a_caption_got_wrong(scenes):
    scene = next(s for s in scenes if len(s.shapes) == 1)
    (shape,) = scene.shapes
    other_kind = next(k for k in dataset.SHAPES if k != shape.kind)
    other_colour = next(c for c in dataset.COLOURS if c not in (shape.colour, scene.background))
    caption = f"a small {{}} {{}} at the top on {dataset.article(scene.background)} {scene.background} background"
    scored = {
        caption.format(shape.colour, shape.kind): dict.fromkeys(SCORES, True),
        caption.format(shape.colour, other_kind): dict(shapes=False, count=True, colours=True, kinds=False),
        caption.format(other_colour, shape.kind): dict(shapes=False, count=True, colours=False, kinds=True),
        caption.format(shape.colour, shape.kind).replace(" on ", f" and a small {shape.colour} {shape.kind} at the "
                                                                    "left on "):
            dict(shapes=False, count=False, colours=False, kinds=False),
        "not a caption": dict.fromkeys(SCORES, False),
    }
    for text, want in scored.items():
        assert caption_scores(text, scene) == want, text


def test_the_command_prints_the_score_and_its_parts(capsys):
    main(["--n", "4"])
    line = capsys.readouterr().out
    assert "of 4 foreign scenes named right" in line
    assert all(f"{part} " in line for part in ("shapes", "colours", "kinds"))
