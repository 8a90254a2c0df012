"""What a generation takes, whatever the model: encoded images and videos, a built prompt with them, and token
ids."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PromptError
from ..prompting.conversation import MediaTokens, Prompt, VideoTokens


@dataclass(frozen=True)
class ImageSource:
    """What an encoded image was made from, so it can be encoded again at another size."""
    image: Any  # as given to encode_images: a path, PIL image, array or [H, W, C] tensor
    resize: str
    srgb: bool
    background: tuple[int, int, int]


@dataclass
class EncodedImages:
    """Vision-tower output for a list of images and videos (in the order prompts use them), reusable across
    prompts."""
    embeds: list[torch.Tensor]  # per item [tokens, hidden]
    grids: list[tuple[int, int, int]]  # per item (t, gh, gw) in patches: t is 1 for an image, a video's frame groups
    timestamps: list[tuple[float, ...] | None] = field(default_factory=list)  # per item: a video's, None for an image
    sources: list[ImageSource] | None = None  # per item, when all are images encode_images made (it keeps them)
    names: list[str | None] = field(default_factory=list)  # per item: the file name it was read from, when known

    def __post_init__(self) -> None:
        if not self.timestamps:
            self.timestamps = [None] * len(self.embeds)
        if not self.names:
            self.names = [None] * len(self.embeds)

    def __len__(self) -> int:
        return len(self.embeds)

    def __getitem__(self, index: int | slice) -> "EncodedImages":
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        return EncodedImages(self.embeds[index], self.grids[index], self.timestamps[index],
                             self.sources[index] if self.sources is not None else None, self.names[index])

    def __add__(self, other: "EncodedImages") -> "EncodedImages":
        known = self.sources is not None and other.sources is not None
        return EncodedImages(self.embeds + other.embeds, self.grids + other.grids, self.timestamps + other.timestamps,
                             self.sources + other.sources if known else None, self.names + other.names)

    @property
    def token_counts(self) -> list[int]:
        """Embedding rows (LM tokens) per item."""
        return [e.shape[0] for e in self.embeds]

    @property
    def prompt_tokens(self) -> list[MediaTokens]:
        """What each item adds to a prompt: an image's token count, a video's VideoTokens."""
        return [count if stamps is None else VideoTokens(count // len(stamps), stamps)
                for count, stamps in zip(self.token_counts, self.timestamps)]


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
