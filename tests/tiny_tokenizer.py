"""The byte-level BPE tokenizer of the tiny test checkpoints: 512 ids, Qwen3.5 control tokens at the top."""
from tokenizers import Tokenizer

from bench.demo_model.build_tokenizer import train_tokenizer

VOCAB_SIZE = 512

_CORPUS = [
    "Describe the image in one sentence.",
    "A red circle at the top left on a blue background.",
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "Panel one: a wide shot of two characters talking in a kitchen, eye-level camera.",
    "How many shapes are there? Two. What colour is the square? Green.",
    "Pixel art sprite of a knight with a sword, side view, transparent background.",
    "日本語のテキストと中文文本，还有 emoji 🙂 and accents: café, naïve, Zürich.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" # $ % & @ ^ _ ` | ~",
]


def build_tiny_tokenizer() -> Tokenizer:
    """Deterministic: the same corpus and vocabulary size always give the same ids."""
    return train_tokenizer(_CORPUS * 20, VOCAB_SIZE)
