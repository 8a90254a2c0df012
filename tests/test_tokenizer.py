"""The tokenizer wrapper, its checks against config.json, and the streaming decoder."""
import copy
import json
import random

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from a3b_core.errors import CheckpointError, ConfigError
from a3b_core.models import parse_config
from a3b_core.prompting.tokenizer import SPECIAL_TOKENS, StreamDecoder, Tokenizer, check_against_config
from tests.tiny_models import MOE_DIMS, TEXT_DIMS, TOKEN_IDS, VISION_DIMS
from tests.tiny_tokenizer import build_tiny_tokenizer

CONFIG = {"model_type": "qwen3_5_moe", "text_config": {**TEXT_DIMS, **MOE_DIMS}, "vision_config": VISION_DIMS,
          **TOKEN_IDS}

TEXT = "Panel one: 日本語のテキスト 🙂🦊 café <think>\nreasoning</think>\n\nA red circle.<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(build_tiny_tokenizer())


def test_control_tokens_in_text_become_ids(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_id("<|im_start|>") and ids[-1] == tok.token_id("<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"


def test_stream_equals_full_decode_and_never_breaks_characters(tok):
    ids = tok.encode(TEXT * 3)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == stream.text == TEXT * 3
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # multi-byte characters were held back at least once


def test_stream_survives_invalid_bytes(tok):
    rng = random.Random(0)
    ids = tok.encode(TEXT) + [rng.randrange(503) for _ in range(300)]
    stream = StreamDecoder(tok)
    streamed = "".join(stream.push(i) for i in ids)
    assert streamed.startswith(TEXT) and tok.decode(ids).startswith(streamed)


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="cannot be read"):
        Tokenizer.from_folder(tmp_path)


def test_unknown_token_is_named(tok):
    with pytest.raises(CheckpointError, match="no token '<nope>'"):
        tok.token_id("<nope>")


def test_truncation_and_padding_from_the_file_are_switched_off():
    text = "The quick brown fox jumps over the lazy dog."
    cut, padded = build_tiny_tokenizer(), build_tiny_tokenizer()
    cut.enable_truncation(max_length=3)
    padded.enable_padding(length=40)
    assert len(cut.encode(text).ids) == 3 and len(padded.encode(text).ids) == 40  # what they would do
    plain = Tokenizer(build_tiny_tokenizer()).encode(text)
    assert Tokenizer(cut).encode(text) == Tokenizer(padded).encode(text) == plain


def test_control_tokens_are_the_special_added_tokens_and_the_templates_own(tok):
    assert set(SPECIAL_TOKENS) <= tok.control_tokens
    assert "<think>" not in tok.control_tokens and "</think>" not in tok.control_tokens
    backend = build_tiny_tokenizer()
    backend.add_special_tokens([AddedToken("<|box_start|>", special=True, normalized=False)])
    backend.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    assert {"<|box_start|>"} == Tokenizer(backend).control_tokens - tok.control_tokens


def test_a_matching_config_passes(tok):
    check_against_config(tok, parse_config(CONFIG), "config.json")
    text_only = copy.deepcopy(CONFIG)
    del text_only["vision_config"], text_only["image_token_id"]  # a text model's default image id is not checked
    check_against_config(tok, parse_config(text_only), "config.json")


@pytest.mark.parametrize("change, error, message", [
    (lambda c: c.update(image_token_id=509), ConfigError,
     r"config.json: image_token_id is 509 but tokenizer.json gives <\|image_pad\|> the id 508"),
    (lambda c: c.update(vision_start_token_id=1), ConfigError, "vision_start_token_id is 1"),
    (lambda c: c["text_config"].update(eos_token_id=[505, 7]), ConfigError,
     "eos_token_id 7 is .* not a control token"),
    (lambda c: c["text_config"].update(vocab_size=510), ConfigError,
     "tokenizer.json has ids up to 511 but config.json's vocab_size is 510"),
])
def test_config_disagreements_name_both_files(tok, change, error, message):
    raw = copy.deepcopy(CONFIG)
    change(raw)
    with pytest.raises(error, match=message):
        check_against_config(tok, parse_config(raw), "config.json")


def test_missing_control_tokens_are_listed():
    with pytest.raises(CheckpointError, match=r"tokenizer.json: lacks <\|image_pad\|>, which"):
        check_against_config(Tokenizer(_without("<|image_pad|>")), parse_config(CONFIG), "config.json")
    with pytest.raises(CheckpointError, match=r"lacks <\|im_start\|>, <\|im_end\|>"):
        check_against_config(Tokenizer(_without("<|im_start|>", "<|im_end|>")), parse_config(CONFIG), "config.json")


def _without(*tokens: str) -> HFTokenizer:
    """The tiny tokenizer with some added tokens removed (through its JSON, as an edited tokenizer.json would be)."""
    data = json.loads(build_tiny_tokenizer().to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in tokens]
    return HFTokenizer.from_str(json.dumps(data))
