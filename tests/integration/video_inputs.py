"""The clip of the video captioning workflow: a red circle moving left to right on white, drawn here frame by frame
and written as a small VP9 WebM into workflows/inputs (copied into ComfyUI's input folder). `python -m
tests.integration.video_inputs` writes it again."""
from __future__ import annotations

from pathlib import Path

import numpy as np

CLIP_NAME = "a3b_red_circle.webm"
CLIP = Path(__file__).resolve().parents[2] / "workflows" / "inputs" / CLIP_NAME
FRAMES, SIZE, FRAME_RATE, RADIUS = 12, 96, 6, 14


def frames() -> np.ndarray:
    """[FRAMES, SIZE, SIZE, 3] uint8: the circle's centre moves evenly from the left edge to the right edge."""
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    clip = np.full((FRAMES, SIZE, SIZE, 3), 255, dtype=np.uint8)
    for index in range(FRAMES):
        centre = RADIUS + (SIZE - 2 * RADIUS) * index / (FRAMES - 1)
        inside = (x - centre) ** 2 + (y - SIZE / 2) ** 2 <= RADIUS ** 2
        clip[index][inside] = (220, 30, 30)
    return clip


def main() -> None:
    import av
    with av.open(str(CLIP), "w") as container:
        stream = container.add_stream("libvpx-vp9", rate=FRAME_RATE, options={"crf": "10", "b": "0"})
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        for pixels in frames():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())


if __name__ == "__main__":
    main()
