"""A .gguf file as load_model's source: the checkpoint (tensors under the release's names), the config.json-like
object, the tokenizer and the chat template, all from the one file (nothing beside it is read)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..models import load_config, parse_config
from ..prompting.folder_template import FolderTemplate
from ..prompting.gguf_tokenizer import tokenizer_from_gguf
from ..prompting.tokenizer import Tokenizer
from ..release.config import ModelConfig
from ..release.gguf import GGUFCheckpoint, metadata
from ..release.gguf_config import config_from_gguf
from ..release.safetensors import Checkpoint

TEMPLATE_KEY = "tokenizer.chat_template"


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


@dataclass
class GGUFSource:
    checkpoint: GGUFCheckpoint
    raw_config: dict
    tokenizer: Tokenizer
    chat_template: FolderTemplate | None  # the file's tokenizer.chat_template, when it has one


def open_gguf(path: Path, with_template: bool) -> GGUFSource:
    """Reads the file's header and metadata (no tensor data); the chat template only `with_template`."""
    checkpoint = GGUFCheckpoint(path)
    raw_config = config_from_gguf(checkpoint.reader, str(path), checkpoint.stored_shapes)
    tokenizer = tokenizer_from_gguf(checkpoint.reader, str(path))
    source = metadata(checkpoint.reader, TEMPLATE_KEY) if with_template else None
    template = FolderTemplate(source, path, f"GGUF {TEMPLATE_KEY}") if isinstance(source, str) else None
    return GGUFSource(checkpoint, raw_config, tokenizer, template)


def model_headers(path: Path) -> tuple[ModelConfig, GGUFCheckpoint | Checkpoint]:
    """The parsed config and the checkpoint of a model folder or a .gguf file, for `plan` and `inspect` (no tensor
    data is read)."""
    if not is_gguf(path):
        return load_config(path), Checkpoint(path)
    checkpoint = GGUFCheckpoint(path)
    raw_config = config_from_gguf(checkpoint.reader, str(path), checkpoint.stored_shapes)
    return parse_config(raw_config, str(path)), checkpoint
