"""A3B Caption Folder's work without ComfyUI: its inputs turned into a FolderJob whose folders stay inside ComfyUI's
input and output folders, and the run's outcomes turned into the node's output lists."""
from __future__ import annotations

from a3b_core.errors import ConfigError
from a3b_core.runtime.options import GenerationOptions
from a3b_core.services.caption_folder import FolderJob, ImageOutcome, Shaping, phrases

from .captions import confined_folder

FOLDER_ROOTS = ["input", "output"]


def folder_job(roots: dict[str, str], folder_root: str, folder: str, output_subfolder: str, *, recursive: bool,
               preset: str, prompt: str, existing: str, trigger_word: str, prefix: str, suffix: str, template: str,
               banned: str, required: str, max_length: int, dry_run: int, start: int, limit: int, batch_size: int,
               size: int, max_new_tokens: int, temperature: float, seed: int) -> FolderJob:
    """The job for the node's inputs. `roots` maps "input" and "output" to ComfyUI's folders: the images' folder is
    inside the chosen one, and a separate caption folder inside the output folder."""
    if folder_root not in roots:
        raise ConfigError(f"folder_root is {folder_root!r}; use one of {', '.join(roots)}.")
    images = confined_folder(roots[folder_root], folder, field="folder", root_name=f"ComfyUI's {folder_root} folder")
    output_dir = None
    if output_subfolder.strip():
        output_dir = confined_folder(roots["output"], output_subfolder, field="output_subfolder")
    shaping = Shaping(trigger=trigger_word, prefix=prefix, suffix=suffix, template=template, ban=phrases(banned),
                      require=phrases(required), max_length=max_length)
    generation = GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature, presence_penalty=0.0,
                                   seed=seed)
    return FolderJob(images, output_dir=output_dir, recursive=recursive, start=start, limit=limit,
                     existing=existing, preset=preset, prompt=prompt.strip() or None, shaping=shaping,
                     dry_run=dry_run, batch_size=batch_size, size=size, generation=generation)


def output_lists(outcomes: list[ImageOutcome]) -> tuple[list[str], list[str]]:
    """(image paths, captions), one entry per image that has a caption after the run: new ones (or, in a dry run,
    the ones shown) and the caption files that were kept."""
    paths, captions = [], []
    for outcome in outcomes:
        if outcome.status in ("written", "dry run"):
            caption = outcome.caption
        elif outcome.status == "skipped":
            try:
                caption = outcome.caption_file.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError):
                continue  # a kept file that is not text is the user's; it is left out of the lists
        else:
            continue
        paths.append(str(outcome.image))
        captions.append(caption)
    return paths, captions

