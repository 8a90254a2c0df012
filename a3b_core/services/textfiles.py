"""Text files written so that a reader never sees half of one: a temporary file beside the target, then os.replace."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from ..errors import ConfigError


def write_text_atomic(path: Path, text: str, overwrite: bool) -> bool:
    """Writes `text` to `path` through a temporary file and os.replace; False when it exists and overwrite is off."""
    try:
        if path.exists() and not overwrite:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = _new_temp_file(path.parent)
        try:
            with os.fdopen(handle, "w", encoding="utf-8", newline="\n") as file:
                file.write(text)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be written ({exc.strerror or exc}). Check that its folder is a folder "
                          "with free space that you can write to, or pick another folder.") from exc
    return True


def _new_temp_file(folder: Path) -> tuple[int, Path]:
    """A new empty file in `folder`: a short name (any legal target name works beside it), and mode 0o666 less the
    umask, like any file a program saves (tempfile.mkstemp would make it 0o600)."""
    while True:
        temp = folder / f".a3b-{secrets.token_hex(8)}.tmp"
        try:
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), temp
        except FileExistsError:
            continue
