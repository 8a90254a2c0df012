"""What a generation takes, whatever the model: encoded images, a built prompt with its images, and token ids."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import PromptError
from .prompt import Prompt


@dataclass(frozen=True)
class ImageSource:
    """What an encoded image was made from, so it can be encoded again at another size."""
    image: Any  # as given to encode_images: a path, PIL image, array or [H, W, C] tensor
    resize: str
    srgb: bool
    background: tuple[int, int, int]


@dataclass
class EncodedImages:
    """Vision-tower output for a list of images, reusable across prompts."""
    embeds: list[torch.Tensor]  # per image [tokens, hidden]
    grids: list[tuple[int, int, int]]  # per image (t, gh, gw) in patches
    sources: list[ImageSource] | None = None  # per image, when known (encode_images keeps them)

    def __len__(self) -> int:
        return len(self.embeds)

    def __getitem__(self, index: int | slice) -> "EncodedImages":
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        return EncodedImages(self.embeds[index], self.grids[index],
                             self.sources[index] if self.sources is not None else None)

    def __add__(self, other: "EncodedImages") -> "EncodedImages":
        known = self.sources is not None and other.sources is not None
        return EncodedImages(self.embeds + other.embeds, self.grids + other.grids,
                             self.sources + other.sources if known else None)

    @property
    def token_counts(self) -> list[int]:
        return [e.shape[0] for e in self.embeds]


@dataclass(frozen=True)
class ChatPrompt:
    """A built prompt together with the encoded images it refers to."""
    prompt: Prompt
    images: EncodedImages

    @property
    def input_ids(self) -> tuple[int, ...]:
        return self.prompt.input_ids


def check_input_ids(input_ids, vocab_size: int) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.numel() == 0 or ids.dtype in (torch.float16, torch.float32, torch.float64, torch.bool):
        raise PromptError(f"input_ids must be a non-empty integer tensor [batch, tokens]; got shape "
                          f"{tuple(ids.shape)} and dtype {ids.dtype}.")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise PromptError(f"input_ids hold ids outside the vocabulary [0, {vocab_size}); got {int(ids.min())}.."
                          f"{int(ids.max())}. Use the model's own tokenizer.")
    return ids.long()
