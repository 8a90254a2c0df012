"""Caption files: where they go (always inside ComfyUI's output folder), what they are named, how they are written."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path, PurePosixPath, PureWindowsPath

from a3b_core.errors import ConfigError


def confined_folder(output_root: str, subfolder: str) -> Path:
    """`output_root/subfolder`, refusing anything that could point outside the output folder."""
    text = subfolder.strip().replace("\\", "/")
    parts = PurePosixPath(text).parts
    if PurePosixPath(text).is_absolute() or PureWindowsPath(subfolder.strip()).drive or ".." in parts:
        raise ConfigError(f"subfolder {subfolder!r} must be a relative folder inside ComfyUI's output folder "
                          f"({output_root}); absolute paths, drive letters and '..' are not allowed. Use a name "
                          "like 'captions/my_dataset', or leave it empty for the output folder itself.")
    root = Path(output_root).resolve()
    folder = root.joinpath(*parts).resolve()
    if not folder.is_relative_to(root):  # a symlink inside the output folder pointing out of it
        raise ConfigError(f"subfolder {subfolder!r} leads outside ComfyUI's output folder ({root}) through a link. "
                          "Pick a subfolder that is a real folder inside the output folder.")
    return folder


def caption_stems(names: str, count: int, prefix: str) -> list[str]:
    """File stems for `count` captions: one per line of `names` (an image file name or stem), else numbered."""
    lines = [line.strip() for line in names.splitlines() if line.strip()]
    if not lines:
        stem = prefix.strip() or "caption"
        return [f"{stem}_{index:05d}" for index in range(1, count + 1)]
    if len(lines) != count:
        raise ConfigError(f"names lists {len(lines)} image names but there are {count} captions. Give one image "
                          "file name per line, in the order of the images, or leave names empty to number the files.")
    stems = []
    for line in lines:
        stem = Path(line.replace("\\", "/")).stem  # a name or a path: keep only the file's stem
        if not stem or stem in (".", ".."):
            raise ConfigError(f"names line {line!r} has no usable file name. Write the image's file name, "
                              "e.g. 'knight.png'.")
        stems.append(stem)
    duplicates = sorted({stem for stem in stems if stems.count(stem) > 1})
    if duplicates:
        raise ConfigError(f"names gives the same file stem more than once ({', '.join(duplicates)}); each caption "
                          "needs its own file. Make the image names unique.")
    return stems


def caption_text(caption: str, trigger_word: str) -> str:
    """The file's text: the optional trigger word first (the usual LoRA dataset convention), then the caption."""
    caption = caption.strip()
    trigger = trigger_word.strip()
    if not trigger:
        return caption + "\n"
    return f"{trigger}, {caption}\n" if caption else trigger + "\n"


def write_text_atomic(path: Path, text: str, overwrite: bool) -> bool:
    """Writes `text` to `path` through a temporary file and os.replace; False when it exists and overwrite is off."""
    if path.exists() and not overwrite:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="\n") as temp:
            temp.write(text)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return True
