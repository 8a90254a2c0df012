"""The model folder's tokenizer.json, wrapped by the `tokenizers` library (no transformers, no remote code)."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ..errors import CheckpointError, ConfigError
from ..release.config import ModelConfig, inside_folder

# Qwen3.5's control tokens, in the order the real vocabulary numbers them. `<think>` and `</think>` are ordinary
# (non-special) added tokens in the real tokenizer, so decoding keeps them in the text.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)
THINK_TOKENS = ("<think>", "</think>")
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")  # every prompt needs them
IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # every image needs them
# config.json's ids of the vision tokens, which must be the tokenizer's.
VISION_TOKEN_IDS = (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                    ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))


class Tokenizer:
    """Text <-> token ids for one model folder."""

    def __init__(self, backend: HFTokenizer, source: str = "tokenizer.json"):
        # A tokenizer.json may carry truncation or padding settings; a prompt must never be cut or padded by them.
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.source = source
        # Text may not contain these (conversation.py refuses them): the chat template's own control tokens and every
        # token tokenizer.json marks special; the think tags excepted, which answers carry as ordinary text.
        special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
        self.control_tokens = frozenset(SPECIAL_TOKENS) | (special - set(THINK_TOKENS))

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(
                f"{path}: tokenizer.json is missing. Copy it from the model's release into the model folder "
                "(it sits beside config.json in every Qwen3.5 download).")
        inside_folder(Path(folder), path, CheckpointError)
        try:
            return cls(HFTokenizer.from_file(str(path)), str(path))
        except Exception as exc:  # the library raises plain Exceptions with terse messages
            raise CheckpointError(f"{path}: cannot be read as a tokenizers JSON file ({exc}). "
                                  "Re-download tokenizer.json from the model's release.") from exc

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; control tokens written in the text (e.g. `<|im_start|>`) become their ids."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise CheckpointError(f"{self.source}: has no token {token!r}, which Qwen3.5 prompts need. "
                                  "Use the tokenizer.json that came with the model.")
        return tid

    def maybe_token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


def check_against_config(tokenizer: Tokenizer, config: ModelConfig, config_path: str) -> None:
    """tokenizer.json checked against config.json when a model is loaded: the control tokens prompts need are there,
    and both files give the vision and end-of-text tokens the same ids (a mix-up would silently mis-tokenize)."""
    needed = CHAT_TOKENS + (IMAGE_TOKENS if config.vision is not None else ())
    missing = [token for token in needed if tokenizer.maybe_token_id(token) is None]
    if missing:
        raise CheckpointError(f"{tokenizer.source}: lacks {', '.join(missing)}, which Qwen3.5 prompts need. Use the "
                              "tokenizer.json that came with the model.")
    mismatch = "The two files come from different models: use the config.json and tokenizer.json of the same release."
    highest = max(tokenizer.backend.get_vocab(with_added_tokens=True).values())
    if highest >= config.text.vocab_size:
        raise ConfigError(f"{config_path}: {tokenizer.source} has ids up to {highest} but config.json's vocab_size is "
                          f"{config.text.vocab_size}. {mismatch}")
    if config.vision is not None:
        for field, token in VISION_TOKEN_IDS:
            expected, found = getattr(config, field), tokenizer.maybe_token_id(token)
            if found is not None and found != expected:
                raise ConfigError(f"{config_path}: {field} is {expected} but {tokenizer.source} gives {token} the id "
                                  f"{found}. {mismatch}")
    for eos in config.text.eos_token_ids:
        token = tokenizer.backend.id_to_token(eos)
        if token not in tokenizer.control_tokens:
            raise ConfigError(f"{config_path}: eos_token_id {eos} is {token!r} in {tokenizer.source}, not a control "
                              f"token such as <|im_end|>, so answers would end at ordinary text. {mismatch}")


class StreamDecoder:
    """Turns token ids into text increments, holding back bytes until they form whole UTF-8 characters.

    Only the ids since the last emitted character boundary are re-decoded (plus a few before it, so merges that
    depend on context decode as they would in full), keeping each step cheap however long the output grows."""

    CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._start = 0  # first id of the window that is re-decoded
        self._done = 0  # ids before this index are fully reflected in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._start:self._done])
        window = self._decode(self.ids[self._start:])
        if window.endswith("\ufffd") or not window.startswith(before):
            return ""  # an incomplete multi-byte character: wait for the next token
        new = window[len(before):]
        self.text += new
        self._done = len(self.ids)
        self._start = max(0, self._done - self.CONTEXT)
        return new
