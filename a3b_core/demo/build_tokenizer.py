"""The demo model's byte-level BPE tokenizer, trained on every word the demo grammar and chat template use."""
from __future__ import annotations

from tokenizers import Tokenizer

from ..tokenizer import train_tokenizer
from .dataset import grammar_phrases

# 256 byte tokens, the merges that make every grammar word and chat-template word one token, Qwen3.5's 9 control
# tokens. Larger sizes fail: the corpus has no more pairs to merge.
DEMO_VOCAB_SIZE = 427

# The text between control tokens in a rendered chat (Qwen3.5 template, thinking off), where the words meet newlines:
# "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|>\n"
# "<|im_start|>assistant\n<think>\n\n</think>\n\na small red circle ...<|im_end|>\n"
CHAT_FRAGMENTS = ("system\n", "user\n", "assistant\n", "\n", "\n\n")


def _corpus() -> list[str]:
    return list(CHAT_FRAGMENTS) + grammar_phrases()


def build_demo_tokenizer() -> Tokenizer:
    """Deterministic: always the same ids."""
    return train_tokenizer(_corpus(), DEMO_VOCAB_SIZE)
