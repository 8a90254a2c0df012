"""M-RoPE position ids (temporal, height, width) for one prompt with images and videos.

Text tokens (vision_start / vision_end and a video's timestamps included) advance one position on all three axes. An
image's block of pad tokens, one per merged patch in row-major order, gets (cur + frame, cur + row, cur + col); after
it the counter jumps by the larger merged side. A video is a run of such blocks, one per frame group, each after its
timestamp text: so each frame group is one time step past the text before it. Generated tokens later sit at absolute
index + rope_delta on all axes.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import PromptError
from ..release.config import ModelConfig


def mrope_position_ids(input_ids: Tensor, image_grids: list[tuple[int, int, int]], pad_ids: int | Sequence[int],
                       spatial_merge_size: int) -> tuple[Tensor, int]:
    """input_ids [T] of one sequence; image_grids (t, gh, gw) in patches, one per unbroken block of pads (ids
    `pad_ids`) in prompt order. Returns (position_ids LongTensor [3, T], rope_delta = max position + 1 - T)."""
    if input_ids.dim() != 1:
        raise PromptError(f"input_ids has shape {tuple(input_ids.shape)}; M-RoPE positions are built for one "
                          "sequence at a time, so pass a 1-D tensor of token ids.")
    device = input_ids.device
    is_image = torch.isin(input_ids, torch.tensor(pad_ids, device=device))
    tokens_per_image = [t * (gh // spatial_merge_size) * (gw // spatial_merge_size) for t, gh, gw in image_grids]
    if any(count <= 0 for count in tokens_per_image):
        raise PromptError(f"image grids {image_grids} include an empty one; each (t, gh, gw) must be positive with "
                          f"gh and gw at least {spatial_merge_size}.")
    found, expected = int(is_image.sum()), sum(tokens_per_image)
    if found != expected:
        raise PromptError(f"the prompt holds {found} image pad tokens (image and video pads, ids {pad_ids}) but the "
                          f"{len(image_grids)} image(s) and frame groups need {expected} ({tokens_per_image}); build "
                          "the prompt with one [[IMG]] marker per image and one [[VID]] per video and let the prompt "
                          "builder expand the pads.")

    pieces: list[Tensor] = []
    cur = 0  # next position value
    cursor = 0  # next token index
    for index, ((t, gh, gw), count) in enumerate(zip(image_grids, tokens_per_image)):
        start = cursor + int(is_image[cursor:].nonzero()[0])
        if not bool(is_image[start:start + count].all()):
            raise PromptError(f"image or frame group {index}'s {count} pad tokens starting at index {start} are "
                              "interrupted by other tokens; each image's (frame group's) pads must be one unbroken "
                              "run.")
        pieces.append(torch.arange(cur, cur + start - cursor, device=device).expand(3, -1))
        cur += start - cursor
        h, w = gh // spatial_merge_size, gw // spatial_merge_size
        frame, row, col = torch.meshgrid(torch.arange(t, device=device), torch.arange(h, device=device),
                                         torch.arange(w, device=device), indexing="ij")
        pieces.append(torch.stack((frame, row, col)).reshape(3, -1) + cur)
        cur += max(h, w)
        cursor = start + count
    pieces.append(torch.arange(cur, cur + len(input_ids) - cursor, device=device).expand(3, -1))

    position_ids = torch.cat(pieces, dim=1)
    rope_delta = int(position_ids.max()) + 1 - len(input_ids) if len(input_ids) else 0
    return position_ids, rope_delta


def positions(config: ModelConfig, input_ids: Tensor, image_grids: list[tuple[int, int, int]]) -> tuple[Tensor, int]:
    """M-RoPE positions [3, T] of one prompt of a model and its rope delta (the Family's `positions`); `image_grids`
    holds one grid per image and video in prompt order, a video's split into its frame groups here."""
    merge = config.vision.spatial_merge_size if config.vision else 2
    groups = [(1, gh, gw) for t, gh, gw in image_grids for _ in range(t)]
    return mrope_position_ids(input_ids, groups, (config.image_token_id, config.video_token_id), merge)
