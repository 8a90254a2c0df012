"""The four panels of the storyboard workflow: a short story of a star and a heart, drawn by the demo model's own data
generator into workflows/inputs (copied into ComfyUI's input folder), so that the shipped workflow has known right
answers to the storyboard request (`bench.demo_model.dataset.STORYBOARD_PROMPT`); `python -m
tests.integration.storyboard_inputs` redraws them."""
from __future__ import annotations

from pathlib import Path

from bench.demo_model.dataset import Scene, Shape, describe_shot, draw_scenes

INPUTS = Path(__file__).resolve().parents[2] / "workflows" / "inputs"
PANELS = {  # a star alone at night, a heart below it, the heart close up, the heart with the star beside it
    "a3b_panel_1.png": Scene((Shape("star", "yellow", "top left", "small"),), "black", False),
    "a3b_panel_2.png": Scene((Shape("star", "yellow", "top", "small"), Shape("heart", "red", "bottom", "small")),
                             "black", False),
    "a3b_panel_3.png": Scene((Shape("heart", "red", "centre", "large"),), "white", False),
    "a3b_panel_4.png": Scene((Shape("heart", "red", "centre", "large"),
                              Shape("star", "yellow", "bottom right", "small")), "orange", True),
}


def expected_shots() -> dict[str, str]:
    return {name: describe_shot(scene) for name, scene in PANELS.items()}


if __name__ == "__main__":
    draw_scenes(PANELS, INPUTS)
