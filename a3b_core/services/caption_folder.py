"""Captioning a folder of images for a training dataset: one .txt per image, beside it or in a mirror folder.

Images are listed (sorted, optionally recursive), then captioned a batch at a time: while the model generates one
batch, the next batch's files are decoded and resized on a worker thread, one at a time and each no larger than its
resize needs (image.load_resized), so only two batches of pixels are ever in memory, each of at most batch_size images
and, past its first image, MAX_BATCH_PIXELS pixels. Each batch is one engine call (its prompts are decoded together).
On a local model the tokens every prompt has before its image (the chat format up to the image) are prefilled once
per run, and each batch starts from them (generation.prefill_prefix); a remote server keeps its own prefix cache.
A caption file is written atomically and only once its caption is complete, so a file that exists is finished: with
`existing="skip"` a rerun, after a Stop, a crash or a power cut, carries on with the images that have none. A run that
changes existing files (overwrite, append, prepend) keeps a journal of what it wrote (_Journal), so that run again
with the same settings it carries on too, and never adds a caption twice.

`caption_folder` is an iterator of FolderProgress steps, so a caller can show progress and stop between batches;
`should_stop` also ends a batch within one token (its unfinished captions are not written).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import string
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from ..errors import ConfigError, ImageError
from ..media.image import load_resized
from ..runtime.loader import A3BModel
from ..runtime.options import RESIZE_MODES, GenerationOptions
from .textfiles import write_text_atomic

if TYPE_CHECKING:
    from ..runtime.generation import SharedPrefix

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
EXISTING_POLICIES = ("skip", "overwrite", "append", "prepend")
DEFAULT_CAPTION_PROMPT = "Describe the image in one sentence."
TAGS_PROMPT = ("List what the image shows as comma-separated tags (subject, colours, style, composition, setting), "
               "most important first. Tags only.")
TEMPLATE_FIELDS = ("name", "folder", "caption")
CAPTION_SUFFIX = ".txt"
MAX_BATCH_PIXELS = 2**26  # resized pixels a prepared batch holds, past its first image (~200 MB as RGB)
RUN_JOURNAL = ".a3b-caption-run.jsonl"  # in the folder the captions go to, while a run that changes files is unfinished
# Dataset captions: greedy (reproducible), and no presence penalty (a caption legitimately repeats "a", "of", ...).
DEFAULT_GENERATION = GenerationOptions(max_new_tokens=160, temperature=0.0, presence_penalty=0.0)


@dataclass(frozen=True)
class Preset:
    """A caption style: the request (None: the model folder's own captioning request) and how pieces are joined."""
    prompt: str | None
    tags: bool  # comma-separated tags: pieces joined with ", ", tags cleaned and deduplicated

    @property
    def separator(self) -> str:
        return ", " if self.tags else " "


PRESETS = {"natural": Preset(None, tags=False), "tags": Preset(TAGS_PROMPT, tags=True)}


@dataclass(frozen=True)
class Shaping:
    """What is done to each caption the model writes, in this order: banned phrases removed, cut to `max_length`
    characters (at a word or tag boundary; 0: no limit), put into `template` ({name}: the image's file name without
    extension, {folder}: its folder's name, {caption}), `prefix` before and `suffix` after, the trigger word first.
    Captions that lack a `require`d phrase are still written, and reported."""
    trigger: str = ""
    prefix: str = ""
    suffix: str = ""
    template: str = "{caption}"
    ban: tuple[str, ...] = ()
    require: tuple[str, ...] = ()
    max_length: int = 0


@dataclass(frozen=True)
class FolderJob:
    folder: Path
    output_dir: Path | None = None  # None: each caption beside its image; else the folder's layout mirrored here
    recursive: bool = False
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS
    start: int = 0  # index into the sorted list of images
    limit: int = 0  # 0: every image from `start`
    existing: str = "skip"  # what to do where an image already has a caption file: EXISTING_POLICIES
    preset: str = "natural"
    prompt: str | None = None  # None: the preset's request
    shaping: Shaping = Shaping()
    dry_run: int = 0  # > 0: caption only the first N images that need one, and write nothing
    batch_size: int = 8
    size: int = 384
    resize: str = "stretch"
    generation: GenerationOptions = DEFAULT_GENERATION
    reuse_prefix: bool = True  # a local model prefills the prompts' shared start once per run (False: with each image)


@dataclass(frozen=True)
class ImageOutcome:
    image: Path
    caption_file: Path
    status: str  # "written" | "skipped" (a caption file exists) | "dry run" | "unreadable" | "refused"
    caption: str = ""  # the file's new text ("" when nothing was captioned)
    detail: str = ""  # why an image was unreadable or refused
    missing: tuple[str, ...] = ()  # required phrases the caption lacks


@dataclass
class FolderProgress:
    """One step of a run: the outcomes it added, and the totals so far."""
    total: int  # images listed
    done: int  # images handled so far, whatever their outcome
    outcomes: list[ImageOutcome]
    captioned: int = 0  # images the model captioned so far
    new_tokens: int = 0
    generation_s: float = 0.0  # time spent in the model so far
    seconds: float = 0.0  # since the run started
    to_caption: int = 0  # images the run will caption in all
    stopped: bool = False

    @property
    def eta_s(self) -> float | None:
        if not self.captioned:
            return None
        return (self.to_caption - self.captioned) * self.seconds / self.captioned

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.generation_s if self.generation_s > 0 else 0.0

    def line(self) -> str:
        """e.g. "40/1200 images · 12.5 img/min · ETA 1h 32m · 41.2 tok/s"."""
        parts = [f"{self.done}/{self.total} images"]
        if self.captioned and self.seconds > 0:
            parts.append(f"{60 * self.captioned / self.seconds:.1f} img/min")
        if self.eta_s is not None:
            parts.append(f"ETA {_duration(self.eta_s)}")
        if self.new_tokens:
            parts.append(f"{self.tokens_per_s:.1f} tok/s")
        if self.stopped:
            parts.append("stopped")
        return " · ".join(parts)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


# ------------------------------------------------------------------------------------------------- checks
def check_job(job: FolderJob) -> None:
    """Every choice of `job` checked before any work, each refusal naming the option and the fix."""
    if not job.folder.is_dir():
        raise ConfigError(f"{job.folder}: no such folder of images. Check the path and pick the folder that holds "
                          "the images.")
    if job.existing not in EXISTING_POLICIES:
        raise ConfigError(f"existing is {job.existing!r}; use one of {', '.join(EXISTING_POLICIES)}.")
    if job.preset not in PRESETS:
        raise ConfigError(f"preset is {job.preset!r}; use one of {', '.join(PRESETS)}.")
    if job.resize not in RESIZE_MODES:
        raise ConfigError(f"resize is {job.resize!r}; use one of {', '.join(RESIZE_MODES)}.")
    for name in ("start", "limit", "dry_run"):
        value = getattr(job, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} is {value!r}; use a whole number of images, 0 or more.")
    if isinstance(job.batch_size, bool) or not isinstance(job.batch_size, int) or job.batch_size < 1:
        raise ConfigError(f"batch_size is {job.batch_size!r}; use a whole number of images, 1 or more.")
    if not job.extensions or not all(ext.startswith(".") for ext in job.extensions):
        raise ConfigError(f"extensions are {job.extensions!r}; give file extensions with their dot, such as .png.")
    check_shaping(job.shaping)


def check_shaping(shaping: Shaping) -> None:
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(shaping.template) if name is not None]
    except ValueError as exc:
        raise ConfigError(f"template {shaping.template!r} is not a valid template ({exc}); write fields as "
                          "{name}, {folder} and {caption}, and a literal brace as {{ or }}.") from None
    unknown = [name for name in fields if name not in TEMPLATE_FIELDS]
    if unknown:
        raise ConfigError(f"template {shaping.template!r} names the field {{{unknown[0]}}}; use only "
                          f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)}.")
    if "caption" not in fields:
        raise ConfigError(f"template {shaping.template!r} has no {{caption}}, so the model's caption would be "
                          "dropped. Put {caption} where the caption goes.")
    if isinstance(shaping.max_length, bool) or not isinstance(shaping.max_length, int) or shaping.max_length < 0:
        raise ConfigError(f"max_length is {shaping.max_length!r}; use a whole number of characters (0: no limit).")


# ------------------------------------------------------------------------------------------------ listing
def list_images(job: FolderJob) -> tuple[list[Path], list[ImageOutcome]]:
    """The job's images, sorted by their path inside the folder, from `start`, at most `limit`; and the image files
    refused because they are links that lead out of the folder."""
    root = job.folder.resolve()
    extensions = {ext.lower() for ext in job.extensions}
    found: list[Path] = []
    refused: list[ImageOutcome] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):  # linked folders are not entered
        if not job.recursive:
            dirnames.clear()
        for name in filenames:
            path = Path(dirpath) / name
            if path.suffix.lower() not in extensions:
                continue
            target = path.resolve()
            if not target.is_relative_to(root):
                refused.append(ImageOutcome(path, caption_path(job, root, path), "refused",
                                            detail=f"a link to {target}, outside the folder"))
                continue
            found.append(path)
    found.sort(key=lambda path: path.relative_to(root).as_posix())
    end = job.start + job.limit if job.limit else None
    return found[job.start:end], refused


def caption_path(job: FolderJob, root: Path, image: Path) -> Path:
    """Where an image's caption goes: beside it, or at the same place under the output folder."""
    relative = image.relative_to(root).with_suffix(CAPTION_SUFFIX)
    return (job.output_dir if job.output_dir is not None else root) / relative


def _check_unique_caption_files(pairs: Sequence[tuple[Path, Path]]) -> None:
    seen: dict[Path, Path] = {}
    for image, caption in pairs:
        if caption in seen:
            raise ConfigError(f"{seen[caption].name} and {image.name} in {image.parent} would both be captioned in "
                              f"{caption.name}. Rename one of them (a trainer pairs an image with the .txt of its "
                              "name), or move it to another folder.")
        seen[caption] = image


def _refusal(path: Path, write_root: Path, what: str = "its caption file") -> str:
    """Why a file cannot be written at `path` ('' when it can): it must stay inside the folder written to, and be a
    regular file if it exists (reading a FIFO or a device would wait forever)."""
    target = path.resolve()
    if not target.is_relative_to(write_root):
        return f"{what} {path} is a link to {target}, outside {write_root}"
    if target.is_dir():
        return f"{what} {path} is a folder"
    if target.exists() and not target.is_file():
        return f"{what} {path} is not a regular file (a FIFO, socket or device)"
    return ""


# ------------------------------------------------------------------------------------------------ shaping
def _phrase_pattern(phrase: str) -> re.Pattern:
    """A phrase as a whole word or words, any case."""
    return re.compile(rf"(?<!\w){re.escape(phrase.strip())}(?!\w)", re.IGNORECASE)


def _tidy(text: str, tags: bool) -> str:
    """Whitespace and separators left clean after phrases were removed; tags stripped and deduplicated."""
    if tags:
        kept: list[str] = []
        for tag in (" ".join(part.split()) for part in text.split(",")):
            tag = tag.strip(" .;:")
            if tag and tag.lower() not in (k.lower() for k in kept):
                kept.append(tag)
        return ", ".join(kept)
    text = " ".join(text.split())
    text = re.sub(r"\s+([,.;:!?])", r"\1", text)
    text = re.sub(r"([,;:])(?:\s*[,;:])+", r"\1", text)
    return text.strip(" ,;:")


def _cut(text: str, max_length: int, tags: bool) -> str:
    """`text` in at most `max_length` characters, cut after the last whole tag or word that fits."""
    if not max_length or len(text) <= max_length:
        return text
    boundary = ", " if tags else " "
    head = text[:max_length + len(boundary)]
    at = head.rfind(boundary, 0, max_length + 1)
    return (text[:at] if at > 0 else text[:max_length]).rstrip(" ,;:")


def shape_caption(caption: str, shaping: Shaping, tags: bool, name: str, folder: str) -> str:
    """The text for a new caption file (see Shaping), without the final newline."""
    body = caption
    for phrase in shaping.ban:
        if phrase.strip():
            body = _phrase_pattern(phrase).sub(" ", body)
    body = _cut(_tidy(body, tags), shaping.max_length, tags)
    body = shaping.template.format(name=name, folder=folder, caption=body)
    separator = PRESETS["tags" if tags else "natural"].separator
    return with_trigger(separator.join(p for p in (shaping.prefix.strip(), body.strip(), shaping.suffix.strip()) if p),
                        shaping.trigger)


def with_trigger(text: str, trigger: str) -> str:
    """The LoRA convention: the trigger word first, then ", "."""
    trigger = trigger.strip()
    if not trigger:
        return text
    return f"{trigger}, {text}" if text else trigger


def without_trigger(text: str, trigger: str) -> str:
    trigger = trigger.strip()
    if trigger and (text == trigger or text.startswith(f"{trigger}, ")):
        return text[len(trigger):].removeprefix(", ")
    return text


def combined(existing: str, new: str, policy: str, shaping: Shaping, tags: bool) -> str:
    """A caption file's text under `policy` ("append" / "prepend" keep what the file held), trigger word first."""
    if policy not in ("append", "prepend") or not existing.strip():
        return new
    old, fresh = without_trigger(existing.strip(), shaping.trigger), without_trigger(new, shaping.trigger)
    separator = PRESETS["tags" if tags else "natural"].separator
    parts = (old, fresh) if policy == "append" else (fresh, old)
    return with_trigger(separator.join(p for p in parts if p), shaping.trigger)


def missing_phrases(text: str, required: Sequence[str]) -> tuple[str, ...]:
    return tuple(phrase for phrase in required if phrase.strip() and not _phrase_pattern(phrase).search(text))


# ------------------------------------------------------------------------------------------------ journal
class _Journal:
    """What a run that changes existing caption files (overwrite / append / prepend) has written, for a rerun after a
    Stop, crash or power cut: those files exist either way, so they cannot say which images are done. The first line
    holds the run's settings; before each caption file is replaced, a line names it (relative to the folder the
    captions go to) with the SHA-256 of its new bytes, flushed to disk. A rerun with the same settings skips every
    image whose file holds exactly those bytes, and redoes one whose replacement never happened, so no caption is added
    twice. A run that ends without a stop deletes the journal; different settings start a new one."""

    def __init__(self, path: Path):
        self.path = path
        self.done: dict[str, str] = {}

    @classmethod
    def resume(cls, path: Path, settings: str) -> _Journal:
        """The journal at `path`, continued when it was written with `settings`, else started afresh."""
        journal = cls(path)
        lines = cls._read_lines(path)
        if lines and lines[0].get("settings") == settings:
            journal.done = {e["file"]: e["sha256"] for e in lines[1:] if isinstance(e.get("file"), str)
                            and isinstance(e.get("sha256"), str)}
        else:
            journal._append({"settings": settings}, mode="w")
        return journal

    @staticmethod
    def _read_lines(path: Path) -> list[dict]:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: the journal of an unfinished caption run cannot be read ({exc}). Delete it to "
                              "start the run afresh (captions already added will then be added again).") from exc
        entries = []
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # the line a crash cut short: its file was never replaced
                continue
            if isinstance(entry, dict):
                entries.append(entry)
        return entries

    def is_done(self, key: str, caption_file: Path) -> bool:
        want = self.done.get(key)
        return want is not None and caption_file.is_file() and _sha256(caption_file.read_bytes()) == want

    def record(self, key: str, data: bytes) -> None:
        self._append({"file": key, "sha256": _sha256(data)})

    def _append(self, entry: dict, mode: str = "a") -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, mode, encoding="utf-8", newline="\n") as file:
                file.write(json.dumps(entry, sort_keys=True) + "\n")
                file.flush()
                os.fsync(file.fileno())
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot be written ({exc.strerror or exc}). Check that the folder the "
                              "captions go to is one you can write to, or pick another output folder.") from exc

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _run_settings(job: FolderJob, request: str) -> str:
    """What decides the text a run writes: a rerun resumes a journal only when these are unchanged."""
    return json.dumps({"existing": job.existing, "preset": job.preset, "request": request,
                       "shaping": asdict(job.shaping)}, sort_keys=True)


# --------------------------------------------------------------------------------------------------- a run
@dataclass
class _Task:
    image: Path
    caption_file: Path
    key: str  # the caption file's path relative to the folder the captions go to, as the journal names it
    existing: str = ""  # the caption file's text, for append / prepend


@dataclass
class _Prepared:
    task: _Task
    image: Image.Image | None = None  # sRGB, resized as the job says
    error: str = ""


def caption_request(model: A3BModel, job: FolderJob) -> str:
    """The request sent with every image: the job's, else the preset's, else the model folder's own captioning
    request, else a plain one."""
    return job.prompt or PRESETS[job.preset].prompt or model.caption_prompt or DEFAULT_CAPTION_PROMPT


def caption_folder(model: A3BModel, job: FolderJob,
                   should_stop: Callable[[], bool] | None = None) -> Iterator[FolderProgress]:
    """Captions the job's folder (see the module's docstring); yields a FolderProgress after the images that are
    skipped up front, and after each batch. A stop ends the iteration with a step marked `stopped`."""
    check_job(job)
    stop = should_stop or (lambda: False)
    root = job.folder.resolve()
    captions_root = job.output_dir if job.output_dir is not None else root
    write_root = captions_root.resolve()
    started = time.perf_counter()
    request = caption_request(model, job)
    images, refused = list_images(job)
    pairs = [(image, caption_path(job, root, image)) for image in images]
    _check_unique_caption_files(pairs)
    journal = None
    if job.existing != "skip" and not job.dry_run:
        journal_path = captions_root / RUN_JOURNAL
        refusal = _refusal(journal_path, write_root, "the run's journal")
        if refusal:
            raise ConfigError(f"{refusal}, so the run cannot note what it writes there. Remove it, or pick another "
                              "output folder.")
        journal = _Journal.resume(journal_path, _run_settings(job, request))
    total = len(images) + len(refused)
    upfront: list[ImageOutcome] = list(refused)
    tasks: list[_Task] = []
    for image, caption in pairs:
        key = caption.relative_to(captions_root).as_posix()
        refusal = _refusal(caption, write_root)
        if refusal:
            upfront.append(ImageOutcome(image, caption, "refused", detail=refusal))
        elif caption.exists() and job.existing == "skip":
            upfront.append(ImageOutcome(image, caption, "skipped"))
        elif journal is not None and journal.is_done(key, caption):
            upfront.append(ImageOutcome(image, caption, "skipped", detail="done by the unfinished run"))
        else:
            tasks.append(_Task(image, caption, key))
    if job.dry_run:
        tasks = tasks[:job.dry_run]
        total = len(upfront) + len(tasks)
    step = FolderProgress(total, len(upfront), upfront, to_caption=len(tasks), seconds=time.perf_counter() - started)
    yield step
    prefix: SharedPrefix | None = None  # made from the first batch's prompts
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="a3b-images") as pool:
        ahead: Future | None = pool.submit(_prepare, job, tasks, 0) if tasks else None
        while ahead is not None:
            prepared, end = ahead.result()
            ahead = pool.submit(_prepare, job, tasks, end) if end < len(tasks) else None
            if stop():
                _cancel(ahead)
                yield _next(step, [], started, stopped=True)
                return
            outcomes, stopped, tokens, seconds, prefix = _caption_batch(model, job, request, prepared, stop, prefix,
                                                                        journal)
            step = _next(step, outcomes, started, stopped=stopped, tokens=tokens, generation_s=seconds)
            if stopped:
                yield step
                _cancel(ahead)
                return
            if ahead is None and journal is not None:
                journal.finish()
            yield step
    if not tasks and journal is not None:
        journal.finish()


def _cancel(future: Future | None) -> None:
    if future is not None:
        future.cancel()


def _next(step: FolderProgress, outcomes: list[ImageOutcome], started: float, stopped: bool = False,
          tokens: int = 0, generation_s: float = 0.0) -> FolderProgress:
    captioned = sum(o.status in ("written", "dry run") for o in outcomes)
    return replace(step, done=step.done + len(outcomes), outcomes=outcomes, captioned=step.captioned + captioned,
                   new_tokens=step.new_tokens + tokens, generation_s=step.generation_s + generation_s,
                   seconds=time.perf_counter() - started, stopped=stopped)


def _prepare(job: FolderJob, tasks: list[_Task], start: int) -> tuple[list[_Prepared], int]:
    """The next batch from tasks[start:], decoded and resized one file at a time (the worker thread's part), and where
    the batch after it starts: a batch ends at batch_size images, or once its images hold MAX_BATCH_PIXELS. An
    unreadable file is kept with its reason. Files for append / prepend are read here too."""
    prepared: list[_Prepared] = []
    pixels = 0
    end = start
    while end < len(tasks) and len(prepared) < job.batch_size and pixels < MAX_BATCH_PIXELS:
        task = tasks[end]
        end += 1
        try:
            image = load_resized(task.image, job.size, job.resize)
        except ImageError as exc:
            prepared.append(_Prepared(task, error=str(exc)))
            continue
        pixels += image.width * image.height
        if job.existing in ("append", "prepend") and task.caption_file.exists():
            try:
                task.existing = task.caption_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                prepared.append(_Prepared(task, error=f"its caption file cannot be read as UTF-8 text ({exc}), so "
                                                      "nothing was added to it"))
                continue
        prepared.append(_Prepared(task, image))
    return prepared, end


def _caption_batch(model: A3BModel, job: FolderJob, request: str, prepared: list[_Prepared],
                   stop: Callable[[], bool], prefix: SharedPrefix | None, journal: _Journal | None
                   ) -> tuple[list[ImageOutcome], bool, int, float, SharedPrefix | None]:
    """One batch through the model and into its files: (outcomes, stopped, new tokens, seconds in the model, the
    run's shared prefix: `prefix`, or made from this batch on a local model)."""
    outcomes = {id(p): ImageOutcome(p.task.image, p.task.caption_file, "unreadable", detail=p.error)
                for p in prepared if p.image is None}
    readable = [p for p in prepared if p.image is not None]
    stopped, tokens, seconds = False, 0, 0.0
    if readable:
        began = time.perf_counter()
        images = model.encode_images([p.image for p in readable], job.size, job.resize, srgb=False)  # sRGB already
        # a caption is one sentence or a tag list: never worth reasoning tokens, whatever the model's default
        prompts = [model.build_prompt(user=request, images=images[i], thinking=False) for i in range(len(readable))]
        options = job.generation.as_kwargs()
        if prefix is None and job.reuse_prefix and isinstance(model, A3BModel):
            prefix = model.prefill_prefix(model.text_before_images(prompts[0]), job.generation.kv_dtype)
        if prefix is not None:
            options["shared_prefix"] = prefix
        results = model.generate_batch(prompts, should_stop=stop, **options)
        seconds = time.perf_counter() - began
        tags = PRESETS[job.preset].tags
        for item, result in zip(readable, results):
            tokens += len(result.token_ids)
            if result.stop_reason == "cancelled":  # an unfinished caption is never written
                stopped = True
                continue
            outcomes[id(item)] = _finish(job, item.task, result.text, tags, journal)
    ordered = [outcomes[id(p)] for p in prepared if id(p) in outcomes]
    return ordered, stopped, tokens, seconds, prefix


def _finish(job: FolderJob, task: _Task, caption: str, tags: bool, journal: _Journal | None) -> ImageOutcome:
    shaping = job.shaping
    new = shape_caption(caption, shaping, tags, task.image.stem, task.image.parent.name)
    text = combined(task.existing, new, job.existing, shaping, tags)
    missing = missing_phrases(text, shaping.require)
    if job.dry_run:
        return ImageOutcome(task.image, task.caption_file, "dry run", text, missing=missing)
    content = text + "\n"
    if journal is not None:
        journal.record(task.key, content.encode("utf-8"))  # the bytes write_text_atomic writes
    if not write_text_atomic(task.caption_file, content, overwrite=job.existing != "skip"):
        return ImageOutcome(task.image, task.caption_file, "skipped")  # written by someone else meanwhile
    return ImageOutcome(task.image, task.caption_file, "written", text, missing=missing)


def summary(outcomes: Sequence[ImageOutcome], stopped: bool = False) -> str:
    """What a run did, for people: counts by outcome, then every image that needs attention, by name."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    lines = [", ".join(f"{count} {status}" for status, count in counts.items()) or "no images found"]
    if stopped:
        lines[0] += " (stopped; run it again with the same settings to carry on)"
    for outcome in outcomes:
        if outcome.status in ("unreadable", "refused"):
            lines.append(f"{outcome.status}: {outcome.image}: {outcome.detail}")
        if outcome.missing:
            lines.append(f"missing {', '.join(repr(m) for m in outcome.missing)}: {outcome.caption_file}")
    return "\n".join(lines)


def run_to_end(model: A3BModel, job: FolderJob, should_stop: Callable[[], bool] | None = None,
               on_step: Callable[[FolderProgress], None] | None = None) -> tuple[list[ImageOutcome], bool]:
    """caption_folder run through: every outcome in order, and whether the run was stopped."""
    outcomes: list[ImageOutcome] = []
    stopped = False
    for step in caption_folder(model, job, should_stop):
        outcomes += step.outcomes
        stopped = step.stopped
        if on_step is not None:
            on_step(step)
    return outcomes, stopped


def phrases(text: str) -> tuple[str, ...]:
    """Phrases written one per line or separated by commas."""
    return tuple(p.strip() for p in re.split(r"[,\n]", text) if p.strip())

