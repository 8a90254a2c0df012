"""Caption files: where they go (always inside ComfyUI's output folder), what they are named, how they are written."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath

from a3b_core.errors import ConfigError
from a3b_core.services.textfiles import write_text_atomic

NAME_MAX = 255  # bytes in one file name: the limit of ext4, XFS, btrfs, APFS and NTFS alike
SUFFIX = ".txt"
# Names Windows gives another meaning (refused everywhere, so a caption folder copies to any system): characters it
# does not allow in a file name (':' would write into a hidden stream of another file), and device names, which stay
# devices whatever extension follows.
WINDOWS_FORBIDDEN = '<>:"|?*'
WINDOWS_DEVICES = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}


def save_captions(output_root: str | Path, captions: Sequence[str], subfolder: str, names: str, prefix: str,
                  trigger_word: str, overwrite: bool, combined_file: str = "") -> str:
    """Writes one caption file per caption (A3B Save Captions), and with `combined_file` one more file holding every
    caption in order, and returns the summary the node shows. Every file's path is checked before the first one is
    written."""
    root = Path(output_root).resolve()
    folder = confined_folder(root, subfolder)
    stems = caption_stems(names, len(captions), prefix)
    texts = [caption_text(caption, trigger_word) for caption in captions]
    files = {f"{stem}{SUFFIX}": text for stem, text in zip(stems, texts)}
    combined = combined_file_name(combined_file, list(files))
    if combined is not None:
        files[combined] = combined_text(stems, texts)
    paths = {name: confined_file(root, folder / name) for name in files}
    lines = []
    for name, text in files.items():
        written = write_text_atomic(paths[name], text, overwrite)
        lines.append(f"{'saved' if written else 'skipped (exists)'}: {name}")
    return f"{folder}\n" + "\n".join(lines)


def combined_file_name(combined_file: str, caption_files: list[str]) -> str | None:
    """The combined file's name (`combined_file`, with .txt added unless it ends so), or None when it is empty; one
    plain name that is none of `caption_files`."""
    _refuse_control_characters(combined_file, "combined_file")
    name = combined_file.strip()
    if not name:
        return None
    name = name if name.lower().endswith(SUFFIX) else name + SUFFIX
    _check_file_name(name, f"combined_file {combined_file!r}")
    # Windows and macOS file systems ignore case: "Shots.txt" there is the file "shots.txt"
    if name.casefold() in {other.casefold() for other in caption_files}:
        raise ConfigError(f"combined_file {combined_file!r} gives the file name {name!r}, which is also one image's "
                          "caption file. Pick another name, e.g. 'shot_list'.")
    return name


def combined_text(stems: list[str], texts: list[str]) -> str:
    """Every caption file's text in order, one line each, as `<stem>: <text>` (a text's own lines joined by
    spaces)."""
    return "".join(f"{stem}: {' '.join(text.strip().splitlines())}\n" for stem, text in zip(stems, texts))


def _refuse_control_characters(text: str, what: str) -> None:
    bad = [char for char in text if ord(char) < 32 or char == "\x7f"]
    if bad:
        raise ConfigError(f"{what} {text!r} holds the control character {bad[0]!r}; a file name cannot hold NUL and "
                          "should hold no control characters. Remove it.")


def confined_folder(output_root: str | Path, subfolder: str, field: str = "subfolder",
                    root_name: str = "ComfyUI's output folder") -> Path:
    """`output_root/subfolder`, refusing anything that could point outside `output_root` (named `root_name` in
    messages, which call the input `field`)."""
    _refuse_control_characters(subfolder, field)
    text = subfolder.strip().replace("\\", "/")
    parts = PurePosixPath(text).parts
    if (PurePosixPath(text).is_absolute() or ".." in parts
            or any(PureWindowsPath(part).drive for part in parts)):  # "C:x" joined on Windows leaves the folder
        raise ConfigError(f"{field} {subfolder!r} must be a relative folder inside {root_name} "
                          f"({output_root}); absolute paths, drive letters and '..' are not allowed. Use a name "
                          f"like 'captions/my_dataset', or leave it empty for {root_name} itself.")
    root = Path(output_root).resolve()
    folder = _resolved(root.joinpath(*parts))
    if not folder.is_relative_to(root):  # a symlink inside the root folder pointing out of it
        raise ConfigError(f"{field} {subfolder!r} leads outside {root_name} ({root}) through a link. "
                          f"Pick a folder that is a real folder inside {root_name}.")
    return folder


def confined_file(root: Path, path: Path) -> Path:
    """`path`, refused unless it resolves (following any link at the file itself) inside `root` to a place a file can
    be written."""
    resolved = _resolved(path)
    if not resolved.is_relative_to(root):
        raise ConfigError(f"{path} is a link to {resolved}, outside ComfyUI's output folder ({root}). Remove the "
                          "link, or pick other names or another subfolder.")
    if os.path.isdir(resolved):
        raise ConfigError(f"{path} is a folder, so the caption cannot be saved under that name. Rename or move the "
                          "folder, or pick other names or another subfolder.")
    return path


def _resolved(path: Path) -> Path:
    """`path` with every link followed, as far as it exists."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a link loop
        raise ConfigError(f"{path}: its links form a loop ({exc}). Remove the link loop, or pick another subfolder "
                          "or other names.") from exc


def _check_file_name(name: str, what: str) -> None:
    """A caption file name must be one plain name that fits the file system."""
    if "/" in name or "\\" in name or PureWindowsPath(name).drive:
        raise ConfigError(f"{what} must be a plain name, without folders, drive letters or '..'; it gives the file "
                          f"name {name!r}. Put folders into 'subfolder' instead.")
    forbidden = [char for char in name if char in WINDOWS_FORBIDDEN]
    if forbidden:
        raise ConfigError(f"{what} gives the file name {name!r}, which holds {forbidden[0]!r}; Windows allows none of "
                          f"{' '.join(WINDOWS_FORBIDDEN)} in a file name. Remove it from the name.")
    device = name.split(".")[0].rstrip(" ").upper()
    if device in WINDOWS_DEVICES:
        raise ConfigError(f"{what} gives the file name {name!r}, which Windows reads as the device {device} "
                          f"(CON, PRN, AUX, NUL, COM1-9 and LPT1-9 are devices there). Rename it, e.g. "
                          f"'{device.lower()}_image'.")
    size = len(os.fsencode(name))
    if size > NAME_MAX:
        raise ConfigError(f"{what} gives a file name of {size} bytes, over the file system's limit of {NAME_MAX} "
                          f"bytes. Shorten it.")


def caption_stems(names: str, count: int, prefix: str) -> list[str]:
    """File stems for `count` captions: one per line of `names` (an image file name or stem), else numbered."""
    _refuse_control_characters(prefix, "filename_prefix")
    lines = [line.strip() for line in names.splitlines() if line.strip()]
    if not lines:
        stem = prefix.strip() or "caption"
        if ".." in stem:
            raise ConfigError(f"filename_prefix {prefix!r} holds '..'; it must be a plain name such as 'caption'. "
                              "Put folders into 'subfolder' instead.")
        _check_file_name(f"{stem}_{count:05d}{SUFFIX}", f"filename_prefix {prefix!r}")  # the longest name
        return [f"{stem}_{index:05d}" for index in range(1, count + 1)]
    if len(lines) != count:
        raise ConfigError(f"names lists {len(lines)} image names but there are {count} captions. Give one image "
                          "file name per line, in the order of the images, or leave names empty to number the files.")
    stems = []
    for number, line in enumerate(lines, 1):
        _refuse_control_characters(line, f"names line {number}")
        stem = PureWindowsPath(line).stem  # a name or a path (either separator, any drive): keep the file's stem
        if not stem or stem in (".", ".."):
            raise ConfigError(f"names line {number} ({line!r}) has no usable file name. Write the image's file "
                              "name, e.g. 'knight.png'.")
        _check_file_name(stem + SUFFIX, f"names line {number} ({line!r})")
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
