"""Builds workflows/<name>.json (UI format) and workflows/api/<name>.json (API format) with ComfyUI's own frontend.

The nodes and links below are placed in the real frontend (headless Chromium), which then serializes the graph and
converts it with app.graphToPrompt(), so both files are exactly what ComfyUI 0.3.75 itself writes.
Run after changing a workflow or a node's inputs:  python -m tests.integration.make_workflows
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.demo_model.clips import MAX_FRAMES, SAMPLE_FPS, VIDEO_PROMPT
from bench.demo_model.dataset import CAPTION_PROMPT, STORYBOARD_PROMPT
from tests.integration.comfy_server import NODE_MODULES, REPO, comfyui_missing_reason, prepare_base, start_server
from tests.integration.pixel_art_inputs import DATASET as PIXEL_ART_DATASET
from tests.integration.storyboard_inputs import PANELS
from tests.integration.video_inputs import CLIP_NAME
from tests.integration.view_inputs import VIEWS

WORKFLOWS = REPO / "workflows"

_LOADER = {"type": "A3BModelLoader", "pos": [40, 60], "size": [330, 300],
           "widgets": {"model": "a3b-demo", "vram_preset": "auto"}}

def _image_row(names: list[str], y: int) -> dict:
    return {f"image{index}": {"type": "LoadImage", "pos": [40 + 250 * index, y], "size": [230, 320],
                              "widgets": {"image": name}} for index, name in enumerate(names)}


def _batched(names: list[str], x: int, y: int) -> tuple[dict, list]:
    """LoadImage nodes joined into one batch by a chain of ImageBatch nodes; returns nodes, links, last key."""
    nodes = _image_row(names, y)
    links = []
    previous = "image0"
    for index in range(1, len(names)):
        key = f"batch{index}"
        nodes[key] = {"type": "ImageBatch", "pos": [x, y + 90 * (index - 1)], "size": [200, 50]}
        links += [[previous, 0, key, "image1"], [f"image{index}", 0, key, "image2"]]
        previous = key
    return nodes, links, previous


def _captioning(names: list[str], system: str, user: str, size: int, captions: dict) -> dict:
    # Row 1: loader, prompt, generate, save. Row 2, below the tall Generate node: images, batching, encoding.
    image_nodes, image_links, batch = _batched(names, 40 + 250 * len(names), 820)
    x = 300 + 250 * len(names)
    return {
        "nodes": {
            "loader": _LOADER,
            **image_nodes,
            "encode": {"type": "A3BImageEncode", "pos": [x, 820], "size": [300, 200],
                       "widgets": {"size": size, "resize": "stretch"}},
            "prompt": {"type": "A3BPrompt", "pos": [410, 60], "size": [440, 320],
                       "widgets": {"system": system, "user": user, "thinking": "off"}},
            "generate": {"type": "A3BGenerate", "pos": [890, 60], "size": [380, 700], "widgets": {
                "mode": "per image", "max_new_tokens": 160, "seed": 7, "control_after_generate": "fixed"}},
            "save": {"type": "A3BSaveCaptions", "pos": [1310, 60], "size": [330, 380],
                     "widgets": {"names": "\n".join(names), **captions}},
        },
        "links": image_links + [["loader", 0, "encode", "model"], [batch, 0, "encode", "image"],
                                ["encode", 0, "prompt", "images"], ["loader", 0, "generate", "model"],
                                ["prompt", 0, "generate", "prompt"], ["generate", 0, "save", "captions"]],
    }


# The three views are scenes of the demo model's generator and the request is the demo model's own (its folder's
# a3b_caption_prompt), so the workflow gives the right captions with "a3b-demo".
MULTI_ANGLE_CAPTIONING = _captioning(
    list(VIEWS),
    system="",
    user=CAPTION_PROMPT,
    size=384,
    captions={"subfolder": "a3b_captions/multi_angle", "if_exists": "overwrite"},
)

# A storyboard's panels in, one shot description per panel out (per-image mode), saved as a shot list: one .txt per
# panel and shot_list.txt with every shot in order. The request is one a real model follows; the panels are drawn by
# the demo model's own generator (tests/integration/storyboard_inputs.py) and it was trained on the request, so the
# workflow gives true shots with "a3b-demo".
STORYBOARD_SHOT_LIST = _captioning(
    list(PANELS),
    system="",
    user=STORYBOARD_PROMPT,
    size=384,
    captions={"subfolder": "a3b_captions/storyboard", "if_exists": "overwrite", "combined_file": "shot_list"},
)

# The pixel-art scenes are drawn by the demo model's own data generator (tests/integration/pixel_art_inputs.py) into
# the dataset folder the workflow captions, so the workflow gives the right captions with "a3b-demo" (whose own
# request is the natural preset's).
PIXEL_ART_LORA_CAPTIONING = {
    "nodes": {
        "loader": _LOADER,
        "caption": {"type": "A3BCaptionFolder", "pos": [410, 60], "size": [420, 1040], "widgets": {
            "folder_root": "input", "folder": PIXEL_ART_DATASET, "output_subfolder": "a3b_captions/pixel_art",
            "preset": "natural", "existing": "skip", "trigger_word": "pxlart", "batch_size": 4}},
        "preview": {"type": "PreviewAny", "pos": [870, 60], "size": [520, 600]},
    },
    "links": [["loader", 0, "caption", "model"], ["caption", 1, "preview", "source"]],
}

# One caption per clip (per-image mode), saved as <clip name>.txt (Video Encode's names output names the clip after
# its file): the layout video LoRA trainers read. The clip is drawn by the demo model's own clip generator and the
# request is the one it was trained on, so the workflow gives the right caption with "a3b-demo"; the frame sampling
# (fps 4, at most 16 frames) is the one its clips were trained with.
VIDEO_LORA_CAPTIONING = {
    "nodes": {
        "loader": _LOADER,
        "video": {"type": "LoadVideo", "pos": [40, 400], "size": [330, 380], "widgets": {"file": CLIP_NAME}},
        "encode": {"type": "A3BVideoEncode", "pos": [410, 400], "size": [330, 300],
                   "widgets": {"fps": SAMPLE_FPS, "max_frames": MAX_FRAMES}},
        "prompt": {"type": "A3BPrompt", "pos": [410, 60], "size": [440, 300], "widgets": {
            "system": "", "user": VIDEO_PROMPT, "thinking": "off"}},
        "generate": {"type": "A3BGenerate", "pos": [890, 60], "size": [380, 700], "widgets": {
            "mode": "per image", "max_new_tokens": 160, "seed": 7, "control_after_generate": "fixed"}},
        "save": {"type": "A3BSaveCaptions", "pos": [1310, 60], "size": [330, 380], "widgets": {
            "subfolder": "a3b_captions/video", "if_exists": "overwrite"}},
    },
    "links": [["loader", 0, "encode", "model"], ["video", 0, "encode", "video"], ["encode", 0, "prompt", "images"],
              ["loader", 0, "generate", "model"], ["prompt", 0, "generate", "prompt"],
              ["generate", 0, "save", "captions"], ["encode", 1, "save", "names"]],
}

SPECS = {"multi_angle_captioning": MULTI_ANGLE_CAPTIONING, "pixel_art_lora_captioning": PIXEL_ART_LORA_CAPTIONING,
         "storyboard_shot_list": STORYBOARD_SHOT_LIST, "video_lora_captioning": VIDEO_LORA_CAPTIONING}


def main() -> None:
    reason = comfyui_missing_reason()
    if reason:
        sys.exit(reason)
    with tempfile.TemporaryDirectory() as work:
        base = Path(work) / "base"
        prepare_base(base, {}, WORKFLOWS / "inputs")
        specs = Path(work) / "specs.json"
        specs.write_text(json.dumps(SPECS))
        server = start_server(base)
        try:
            env = dict(os.environ, A3B_PLAYWRIGHT=str(NODE_MODULES / "playwright-core"))
            subprocess.run(["node", str(Path(__file__).with_name("frontend.cjs")), "build", server.url,
                            str(WORKFLOWS), str(specs)], check=True, env=env)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
