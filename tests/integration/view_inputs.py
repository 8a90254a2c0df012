"""The three views of the multi-view captioning workflow: one scene (a large orange star on a blue background) as a
camera panning from right to left sees it, the star at the left, the centre and the right. They are drawn by the demo
model's own data generator into workflows/inputs (copied into ComfyUI's input folder), so that the shipped workflow
has known right answers; `python -m tests.integration.view_inputs` redraws them."""
from __future__ import annotations

from pathlib import Path

from bench.demo_model.dataset import Scene, Shape, describe, draw_scenes

INPUTS = Path(__file__).resolve().parents[2] / "workflows" / "inputs"
VIEWS = {f"a3b_view_{place}.png": Scene((Shape("star", "orange", position, "large"),), "blue", False)
         for place, position in (("left", "left"), ("centre", "centre"), ("right", "right"))}


def expected_captions() -> dict[str, str]:
    return {name: describe(scene) for name, scene in VIEWS.items()}


if __name__ == "__main__":
    draw_scenes(VIEWS, INPUTS)
