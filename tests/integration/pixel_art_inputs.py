"""The pixel-art pictures of the LoRA captioning workflow: scenes of the demo model's own generator, so the shipped
workflow has known right answers. They lie in the folder the workflow captions, workflows/inputs/a3b_pixel_art (copied
into ComfyUI's input folder); `python -m tests.integration.pixel_art_inputs` redraws them."""
from __future__ import annotations

from pathlib import Path

from bench.demo_model.dataset import Scene, Shape, describe, draw_scenes

DATASET = "a3b_pixel_art"  # the folder inside ComfyUI's input folder
INPUTS = Path(__file__).resolve().parents[2] / "workflows" / "inputs" / DATASET
SCENES = {
    "a3b_pixel_heart.png": Scene((Shape("heart", "red", "centre", "large"),), "white", True),
    "a3b_pixel_star_circle.png": Scene((Shape("star", "yellow", "top left", "large"),
                                        Shape("circle", "purple", "bottom right", "small")), "black", True),
    "a3b_pixel_triangle.png": Scene((Shape("triangle", "green", "top", "large"),), "blue", True),
    "a3b_pixel_square.png": Scene((Shape("square", "orange", "left", "small"),), "purple", True),
}


def expected_captions() -> dict[str, str]:
    return {name: describe(scene) for name, scene in SCENES.items()}


if __name__ == "__main__":
    draw_scenes(SCENES, INPUTS)
