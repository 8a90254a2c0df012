"""The tokenizer wrapper and the streaming decoder."""
import random

import pytest

from a3b_core.errors import CheckpointError
from a3b_core.tokenizer import StreamDecoder, Tokenizer
from tests.tiny_tokenizer import build_tiny_tokenizer

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
