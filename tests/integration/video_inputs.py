"""The clip of the video captioning workflow: a large red circle moving from the left to the right on white, drawn by
the demo model's own clip generator (`bench.demo_model.clips`) and written as a small VP9 WebM into workflows/inputs
(copied into ComfyUI's input folder), so that the shipped workflow has a known right answer. `python -m
tests.integration.video_inputs` writes it again."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from bench.demo_model.clips import CLIP_FRAME_RATE, Clip, describe_clip, draw_clip

CLIP_NAME = "a3b_red_circle.webm"
CLIP = Path(__file__).resolve().parents[2] / "workflows" / "inputs" / CLIP_NAME
SCENE = Clip(kind="circle", colour="red", size="large", start="left", end="right", background="white")
FRAME_RATE = CLIP_FRAME_RATE


def frames() -> np.ndarray:
    """[frames, 384, 384, 3] uint8, as the generator draws the clip."""
    return draw_clip(SCENE, random.Random(0))


def expected_caption() -> str:
    return describe_clip(SCENE)


def main() -> None:
    import av
    pixels = frames()
    with av.open(str(CLIP), "w") as container:
        stream = container.add_stream("libvpx-vp9", rate=int(FRAME_RATE), options={"crf": "10", "b": "0"})
        stream.width, stream.height = pixels.shape[2], pixels.shape[1]
        stream.pix_fmt = "yuv420p"
        for frame in pixels:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


if __name__ == "__main__":
    main()
