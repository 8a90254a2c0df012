"""A .gguf file as load_model's source: the checkpoint (tensors under the release's names), the config.json-like
object, the tokenizer and the chat template, all from the one file; the vision tower from its mmproj GGUF (found
beside it, or named), when there is one."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from ..models import load_config, parse_config
from ..prompting.folder_template import FolderTemplate
from ..prompting.gguf_tokenizer import tokenizer_from_gguf
from ..prompting.tokenizer import Tokenizer
from ..release.config import ModelConfig
from ..release.gguf import GGUFCheckpoint, metadata
from ..release.gguf_config import config_from_gguf
from ..release.gguf_mmproj import GGUFWithVision, MmprojCheckpoint, find_mmproj
from ..release.safetensors import Checkpoint

TEMPLATE_KEY = "tokenizer.chat_template"
MMPROJ_CHOICES = ("auto", "none")  # besides the path of an mmproj file


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


@dataclass
class GGUFSource:
    checkpoint: GGUFCheckpoint | GGUFWithVision
    raw_config: dict
    tokenizer: Tokenizer
    chat_template: FolderTemplate | None  # the file's tokenizer.chat_template compiled, when it has one and it is used
    template_text: str | None  # the file's tokenizer.chat_template
    mmproj: Path | None  # the vision projector in use


def mmproj_path(model_path: Path, mmproj: str | Path) -> Path | None:
    """The mmproj file that `mmproj` asks for: "auto" the one beside the model (None if there is none), "none" None,
    else the path given, which must be a .gguf file."""
    if str(mmproj) == "none":
        return None
    if str(mmproj) == "auto":
        return find_mmproj(model_path)
    path = Path(mmproj).expanduser()
    if not is_gguf(path):
        raise CheckpointError(f"mmproj {str(mmproj)!r} is not a .gguf file. Pass the path of the model's "
                              "mmproj-*.gguf, 'auto' (the mmproj beside the model) or 'none' (text only).")
    return path


def with_vision(path: Path, text: GGUFCheckpoint, raw_config: dict,
                mmproj: str | Path) -> tuple[GGUFCheckpoint | GGUFWithVision, Path | None]:
    """The model's checkpoint joined with its mmproj's vision tensors, and raw_config given its vision_config; the
    text checkpoint alone when there is no mmproj."""
    found = mmproj_path(path, mmproj)
    if found is None:
        return text, None
    vision = MmprojCheckpoint(found)
    try:
        vision.check_fits(path, raw_config["text_config"], raw_config["model_type"])
    except CheckpointError:
        vision.close()
        raise
    raw_config["vision_config"] = vision.vision_config
    return GGUFWithVision(text, vision), found


def open_gguf(path: Path, with_template: bool, mmproj: str | Path = "auto") -> GGUFSource:
    """Reads the file's header and metadata (no tensor data), and the mmproj's; the chat template is compiled only
    `with_template`."""
    text = GGUFCheckpoint(path)
    raw_config = config_from_gguf(text.reader, str(path), text.stored_shapes)
    tokenizer = tokenizer_from_gguf(text.reader, str(path))
    source = metadata(text.reader, TEMPLATE_KEY)
    source = source if isinstance(source, str) else None
    template = FolderTemplate(source, path, f"GGUF {TEMPLATE_KEY}") if with_template and source is not None else None
    checkpoint, found = with_vision(path, text, raw_config, mmproj)
    return GGUFSource(checkpoint, raw_config, tokenizer, template, source, found)


def model_headers(path: Path, mmproj: str | Path = "auto") -> tuple[ModelConfig, GGUFCheckpoint | GGUFWithVision |
                                                                     Checkpoint]:
    """The parsed config and the checkpoint of a model folder or a .gguf file (with its mmproj), for `plan` and
    `inspect` (no tensor data is read)."""
    if not is_gguf(path):
        return load_config(path), Checkpoint(path)
    text = GGUFCheckpoint(path)
    raw_config = config_from_gguf(text.reader, str(path), text.stored_shapes)
    checkpoint, _ = with_vision(path, text, raw_config, mmproj)
    return parse_config(raw_config, str(path)), checkpoint
