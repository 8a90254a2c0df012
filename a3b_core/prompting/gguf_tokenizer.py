"""The tokenizer of a GGUF file, rebuilt from its metadata (tokenizer.ggml.*) with the `tokenizers` library: the
byte-level BPE vocabulary and merges, the pre-tokenizer regex llama.cpp names by `tokenizer.ggml.pre`, and the
added tokens (CONTROL: special, USER_DEFINED: ordinary added text such as <think>), so that it gives the ids the
release's tokenizer.json gives.

The regexes are llama.cpp's (llama-vocab.cpp) in the spelling of the Hugging Face tokenizer.json they come from.
Hugging Face's Qwen tokenizers normalize to NFC, which the GGUF does not record: it is applied for the Qwen
pre-tokenizers, as the release's tokenizer.json does.
"""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import CheckpointError
from .tokenizer import Tokenizer

QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_REGEXES = {"qwen2": QWEN2, "qwen35": QWEN35}
GPT2 = "gpt-2"  # the plain GPT-2 byte-level regex (tiny test vocabularies)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def field(reader: Any, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None else value.contents()


def tokenizer_from_gguf(reader: Any, source: str) -> Tokenizer:
    """The Tokenizer of a GGUF file read by gguf.GGUFReader; `source` names the file in messages."""
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"{source}: tokenizer.ggml.model is {model!r}; Qwen GGUFs have the byte-level BPE "
                              "tokenizer 'gpt2'. The file is of another model family or has no tokenizer.")
    pre = field(reader, "tokenizer.ggml.pre", GPT2)
    if pre not in SPLIT_REGEXES and pre != GPT2:
        raise CheckpointError(f"{source}: tokenizer.ggml.pre is {pre!r}; this pack knows the Qwen pre-tokenizers "
                              f"{', '.join([*SPLIT_REGEXES, GPT2])}. The file is of another model family.")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    merges = field(reader, "tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not isinstance(merges, list):
        raise CheckpointError(f"{source}: the tokenizer metadata (tokenizer.ggml.tokens / merges) is missing. "
                              "Convert the model again with llama.cpp's convert_hf_to_gguf.py.")
    if not isinstance(types, list) or len(types) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.token_type has {len(types) if isinstance(types, list) else 0}"
                              f" entries for {len(tokens)} tokens. The file is corrupt: download it again.")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens lists a token twice. The file is corrupt: download "
                              "it again.")
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space or left not in vocab or right not in vocab:
            raise CheckpointError(f"{source}: the merge {merge!r} is not two tokens of the vocabulary. The file is "
                                  "corrupt: download it again.")
        pairs.append((left, right))
    try:
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as exc:  # the library raises plain Exceptions
        raise CheckpointError(f"{source}: the tokenizer metadata cannot be built into a BPE tokenizer ({exc}). "
                              "The file is corrupt: download it again.") from exc
    if pre == GPT2:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_REGEXES[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types) if kind == CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(types) if kind == USER_DEFINED])
    return Tokenizer(backend, source)
