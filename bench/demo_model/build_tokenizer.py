"""Byte-level BPE tokenizers for the project's own small models (`train_tokenizer`: the test fixtures' and the demo
model's), and the demo model's, trained on every word the demo grammar and chat template use."""
from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from a3b_core.prompting.tokenizer import SPECIAL_TOKENS, THINK_TOKENS

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


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with Qwen3.5's control tokens as the last ids of the vocabulary.

    Used for the project's own small models (test fixtures, the demo model); real models ship their tokenizer.json.
    """
    added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - added, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(f"corpus too small for a {vocab_size}-token vocabulary")
    return tok
