"""load_model() and A3BModel: the engine contract the nodes, the CLI and the tests use."""
from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError, ImageError, PromptError, VideoError
from ..formats.table import CONVERTED_FORMATS, FORMAT_OF_DTYPE, format_named
from ..media import image as image_pipeline
from ..media import video as video_pipeline
from ..models import family_of
from ..prompting.built_in_templates import BUILT_IN_TEMPLATES
from ..prompting.conversation import VIDEO_PAD, Turn, VideoTokens, tokenize
from ..prompting.folder_template import FolderTemplate, find_chat_template
from ..prompting.tokenizer import Tokenizer, check_against_config
from ..release.config import ModelConfig, read_config
from ..release.gguf_mmproj import GGUFWithVision
from ..release.safetensors import Checkpoint
from ..release.weights import Progress, find_prefix, load_module, move
from . import cpu_swaps, devices
from .adapters import LoraRequest, ModelAdapters
from .forward import ForwardPass
from .gguf_source import MMPROJ_CHOICES, is_gguf, open_gguf
from .generation import SharedPrefix, generate, generate_batch, prefill_prefix
from .inputs import ChatPrompt, EncodedImages, ImageSource
from .options import BUILT_IN_TEMPLATE, CHAT_TEMPLATES, COMPUTE_DTYPES
from .placement import Plan, make_plan
from .sequence_output import GenerationResult

EXPERT_CACHE_VERSION = 2  # 2: int4 in experts.quantize_int4's own layout
VIDEO_GROUPS_PER_PASS = 8  # frame groups through the vision tower at once: bounds its memory for long clips
DEMO_MODEL_NAME = "a3b-demo"  # load_model's default
DEMO_MODELS = {name: Path(__file__).parents[1] / "demo" / name for name in (DEMO_MODEL_NAME, "a3b-demo-fp8")}


@dataclass
class LoadStats:
    seconds: float = 0.0
    tensors: int = 0


def resolve_model_path(path: str | Path | None) -> Path:
    """The model folder for `path`: the name of an embedded demo model (None: a3b-demo), else a folder path, or the
    path of a .gguf file. Every command and load_model name models this way."""
    name = DEMO_MODEL_NAME if path is None else str(path)
    if name in DEMO_MODELS:
        folder = DEMO_MODELS[name]
        if not (folder / "config.json").is_file():
            raise ConfigError(f"the embedded demo model is missing from {folder}; reinstall the pack or pass "
                              "the path of a model folder.")
        return folder
    folder = Path(name).expanduser()
    if name.strip() and is_gguf(folder):
        return folder
    if not name.strip() or not folder.is_dir():
        raise ConfigError(f"{folder}: model folder not found. Pass the folder that holds config.json and the "
                          f".safetensors files (for example models/LLM/Qwen3.5-35B-A3B), or the name of an "
                          f"embedded demo model ({', '.join(DEMO_MODELS)}).")
    return folder


def resolve_compute_dtype(compute_dtype: str, device: torch.device) -> torch.dtype:
    """auto is bf16 where it runs natively: on CPUs, where it halves the weights read per token, and on GPUs from
    Ampere on. Older GPUs get fp16, whose narrower range the text model guards (model.FP16_LIMIT). Norms, softmaxes
    and the DeltaNet state stay fp32 regardless."""
    if compute_dtype == "auto":
        return torch.bfloat16 if devices.bf16_is_native(device) else torch.float16
    if compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"compute_dtype {compute_dtype!r} is not supported; use one of: auto, "
                          f"{', '.join(COMPUTE_DTYPES)}.")
    return COMPUTE_DTYPES[compute_dtype]


class A3BModel(ForwardPass):
    """A loaded model: its text model's forward pass (ForwardPass), vision tower and tokenizer, and the entry points
    the nodes, the CLI and the services call: encode images and videos, build prompts, generate."""

    def __init__(self, folder: Path, config: ModelConfig, text: torch.nn.Module, vision: torch.nn.Module | None,
                 tokenizer: Tokenizer | None, plan: Plan, device: torch.device, dtype: torch.dtype,
                 load_stats: LoadStats, chat_template: FolderTemplate | None = None,
                 carried_template: str | None = None):
        super().__init__(folder, config, text, plan, device, dtype)
        self.built_in_template = BUILT_IN_TEMPLATES[self.family.name]
        # a model that always (never) thinks: True (False); None: as each prompt asks (carried_template: the
        # chat template a GGUF file carries, which tells its variant whichever template prompts use)
        self.fixed_thinking = self.built_in_template.fixed_thinking(folder, carried_template)
        self.vision = vision
        self.tokenizer = tokenizer
        self.load_stats = load_stats
        self.chat_template = chat_template  # the folder's own, or None for the family's built-in one
        self.default_thinking = self._default_thinking()
        self.adapters = ModelAdapters(text, vision, self.family.vision_prefixes, dtype, str(folder))

    def _default_thinking(self) -> bool:
        """Whether prompts think when the caller does not say: a variant's fixed mode (Qwen3-VL), else config.json's
        a3b_default_thinking, else the chat template's own default (the folder's template rendered without
        enable_thinking; the built-in Qwen3.5 template thinks, as Qwen's own does)."""
        if self.fixed_thinking is not None:
            return self.fixed_thinking
        if self.config.default_thinking is not None:
            return self.config.default_thinking
        folder_default = self.chat_template.default_thinking() if self.chat_template is not None else None
        return self.built_in_template.default_thinking if folder_default is None else folder_default

    @property
    def chat_template_in_use(self) -> str:
        """Which chat template builds prompts: "model folder: <file>" or "built-in"."""
        return self.chat_template.in_use if self.chat_template is not None else BUILT_IN_TEMPLATE

    @property
    def caption_prompt(self) -> str | None:
        """The model folder's own captioning request (config.json's a3b_caption_prompt), if it has one."""
        return self.config.caption_prompt

    # ------------------------------------------------------------------------------------------- adapters
    def set_loras(self, loras: LoraRequest) -> None:
        """Puts exactly these LoRA adapters on the model: (PEFT adapter folder or its .safetensors file, strength)
        pairs, strength scaling each adapter's effect (0: off; negative: inverted). [] gives the base model back
        exactly; the base weights are never changed, whatever their format. Every adapter is checked before anything
        changes: on an error (AdapterError, naming the adapter) the model keeps the adapters it had."""
        self.require_loaded()
        self.adapters.set(loras)

    @property
    def loras(self) -> list[tuple[Path, float]]:
        """The adapters on the model: (weights file, strength) in the order given."""
        return list(self.adapters.active)

    # ------------------------------------------------------------------------------------------- images
    @torch.inference_mode()
    def encode_images(self, images, size: int = 384, resize: str = "stretch", srgb: bool = True,
                      background: tuple[int, int, int] = (255, 255, 255),
                      progress: Progress | None = None) -> EncodedImages:
        """Any images (paths, PIL, arrays, a ComfyUI IMAGE batch) -> vision embeddings, one entry per image. The
        embeddings are kept in RAM (a few hundred KiB per image), not on the GPU, and join the prompt when used.

        `srgb=False` ignores embedded ICC profiles (the pixels are taken as sRGB already); `background` is the colour
        transparent pixels are composited over. `progress(done, total)` is called after each image."""
        self.require_vision()
        vcfg = self.config.vision
        items = image_pipeline.split_batch(images)
        patches = image_pipeline.preprocess_images(
            items, size=size, mode=resize, srgb=srgb, background=background, patch_size=vcfg.patch_size,
            temporal_patch_size=vcfg.temporal_patch_size, merge_size=vcfg.spatial_merge_size)
        encoded = self.encode_patches(patches, len(items), progress)
        encoded.sources = [ImageSource(item, resize, srgb, tuple(background)) for item in items]
        return encoded

    @torch.inference_mode()
    def encode_patches(self, patches: Iterable[tuple[torch.Tensor, tuple[int, int, int]]], total: int,
                       progress: Progress | None = None) -> EncodedImages:
        """Preprocessed images (image.preprocess's results) through the vision tower, one entry per image."""
        vision = self.require_vision()
        vision_device = vision.pos_embed.weight.device
        embeds, grids = [], []
        for pixels, grid in patches:
            embeds.append(vision(pixels.to(vision_device, self.dtype), [grid]).cpu())
            grids.append(grid)
            if progress is not None:
                progress(len(grids), total)
        return EncodedImages(embeds, grids)

    # ------------------------------------------------------------------------------------------- videos
    @torch.inference_mode()
    def encode_video(self, video, frame_rate: float | None = None, fps: float = video_pipeline.DEFAULT_FPS,
                     min_frames: int = video_pipeline.MIN_FRAMES, max_frames: int = video_pipeline.MAX_FRAMES,
                     max_frame_tokens: int = video_pipeline.MAX_FRAME_TOKENS,
                     max_pixels: int = video_pipeline.MAX_PIXELS,
                     progress: Progress | None = None) -> EncodedImages:
        """One clip -> its vision embeddings, one item that a prompt places with [[VID]] (and that joins encoded
        images with +). `video`: a video file path (decoded with PyAV, else OpenCV), or frames [T, H, W, C] (uint8,
        or float 0..1 as ComfyUI's IMAGE; or a list of [H, W, C] frames of one size) shown at `frame_rate` frames per
        second.

        As Qwen's video processor: `fps` frames per second of the clip are sampled, at least `min_frames` and at most
        `max_frames`; every frame is resized to one size of at most `max_frame_tokens` LM tokens (and the clip to
        `max_pixels` pixels in all); frames go in pairs, each pair one frame group with its timestamp in the prompt.
        A clip whose tokens the model's context cannot hold is refused before the vision tower runs.
        `progress(done, total)` is called after each batch of frame groups."""
        vision = self.require_vision()
        vcfg = self.config.vision
        name = video_pipeline.describe(video)
        clip = video_pipeline.load_video(video, frame_rate)
        sampled = video_pipeline.preprocess_video(
            clip.frames, clip.frame_rate, fps=fps, min_frames=min_frames, max_frames=max_frames,
            max_frame_tokens=max_frame_tokens, max_pixels=max_pixels, patch_size=vcfg.patch_size,
            temporal_patch_size=vcfg.temporal_patch_size, merge_size=vcfg.spatial_merge_size, name=name)
        self._check_video_fits(sampled, clip, fps, name)
        groups, gh, gw = sampled.grid
        per_group = gh * gw
        vision_device = vision.pos_embed.weight.device
        embeds = []
        for start in range(0, groups, VIDEO_GROUPS_PER_PASS):  # frame groups are independent in the vision tower
            count = min(VIDEO_GROUPS_PER_PASS, groups - start)
            pixels = sampled.pixel_values[start * per_group:(start + count) * per_group]
            embeds.append(vision(pixels.to(vision_device, self.dtype), [(count, gh, gw)]).cpu())
            if progress is not None:
                progress(start + count, groups)
        return EncodedImages([torch.cat(embeds)], [sampled.grid], [sampled.timestamps])

    def _check_video_fits(self, sampled: video_pipeline.SampledVideo, clip: video_pipeline.VideoFrames, fps: float,
                          name: str) -> None:
        """Refuses a clip whose prompt tokens alone fill the model's context, saying which frame count and fps fit."""
        groups, gh, gw = sampled.grid
        merge = self.config.vision.spatial_merge_size
        item = VideoTokens(gh * gw // merge ** 2, sampled.timestamps)
        tokens = len(tokenize(self.tokenizer, VIDEO_PAD, (item,))) if self.tokenizer is not None else \
            groups * (item.group_tokens + 2)
        if tokens < self.max_context:
            return
        frames_per_group = self.config.vision.temporal_patch_size
        fitting_groups = (self.max_context - 1) * groups // tokens
        frames = fitting_groups * frames_per_group
        seconds = clip.frames.shape[0] / clip.frame_rate
        fit = (f"lower max_frames to {frames} or fewer (fps {frames / seconds:.3g} samples that many from this "
               f"{seconds:.3g} s clip)" if frames else "no frame count fits at this frame size")
        raise VideoError(f"{name}: {len(sampled.frame_indices)} frames sampled at fps {fps:g} give {tokens} prompt "
                         f"tokens, but the model's context holds {self.max_context}. To fit, {fit}; or lower "
                         "max_frame_tokens for smaller frames, or load the model with a larger max_context.")

    def require_vision(self) -> torch.nn.Module:
        self.require_loaded()
        if self.vision is None and is_gguf(self.folder):
            raise ImageError(f"{self.folder}: this GGUF model was loaded without a vision tower (no mmproj); put the "
                             "mmproj file beside the model or pass mmproj= (the CLI's --mmproj, the loader node's "
                             "mmproj input) to use images.")
        if self.vision is None:
            raise ImageError(f"{self.folder}: this model has no vision tower (config.json has no vision_config or "
                             "the model.visual.* weights are missing); use a vision-language model for images.")
        return self.vision

    # ------------------------------------------------------------------------------------------- prompts
    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ConfigError(f"{self.folder}: tokenizer.json is missing, so text prompts cannot be built. Copy it "
                              "from the model's release into the folder.")
        return self.tokenizer

    def build_prompt(self, user: str = "", system: str | None = None, images: EncodedImages | None = None,
                     thinking: bool | None = None, history: Sequence[Turn] = (),
                     add_vision_id: bool = False) -> "ChatPrompt":
        """The conversation as this model's chat template renders it, with the images' embeddings; `thinking` None
        takes the model's default_thinking."""
        self.require_loaded()
        images = images if images is not None else EncodedImages([], [])
        if not isinstance(images, EncodedImages):
            raise PromptError(f"images is a {type(images).__name__}; pass the result of model.encode_images(...), "
                              "which turns pictures into what the model reads.")
        if self.fixed_thinking is not None:  # the model's variant decides, whatever the prompt asks
            thinking = self.fixed_thinking
        elif thinking is None:
            thinking = self.default_thinking
        template = (self.chat_template.build_prompt if self.chat_template is not None
                    else self.built_in_template.build_prompt)
        prompt = template(self.require_tokenizer(), user, system=system, image_token_counts=images.prompt_tokens,
                          thinking=thinking, history=history, add_vision_id=add_vision_id)
        return ChatPrompt(prompt, images)

    # ------------------------------------------------------------------------------------------- generation
    def generate(self, prompt, **options) -> GenerationResult:
        """See a3b_core.runtime.generation.generate."""
        return generate(self, prompt, **options)

    def generate_batch(self, prompts, **options) -> list[GenerationResult]:
        """See a3b_core.runtime.generation.generate_batch."""
        return generate_batch(self, prompts, **options)

    def prefill_prefix(self, ids: Sequence[int], kv_dtype: str | None = None) -> SharedPrefix:
        """See a3b_core.runtime.generation.prefill_prefix."""
        return prefill_prefix(self, ids, kv_dtype)

    def text_before_images(self, prompt: ChatPrompt) -> list[int]:
        """A built prompt's tokens before its first image or clip (all of them when it has none)."""
        ids = list(prompt.input_ids)
        pads = self.vision_pads(torch.tensor(ids)).nonzero()
        return ids[:int(pads[0, 0])] if len(pads) else ids

    def release(self) -> None:
        """Drops the weights; the handle cannot be used afterwards (load the model again)."""
        self.adapters.release()
        self.text = None
        self.vision = None
        devices.empty_cache(self.device)


def expert_cache_dir(ckpt: Checkpoint, fmt: str) -> Path:
    """Where converted experts of this checkpoint are kept: keyed by the weight files' names, sizes and times, and by
    the cache's format version (its layouts are the same on every CPU)."""
    root = Path(os.environ.get("A3B_CACHE_DIR", Path.home() / ".cache" / "a3b-nodes")) / "experts"
    key = hashlib.sha256(repr((str(ckpt.folder.resolve()), fmt, EXPERT_CACHE_VERSION, [
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in ckpt.files])).encode()).hexdigest()[:16]
    return root / f"{ckpt.folder.name}-{fmt}-{key}"


def load_model(path: str | Path | None = DEMO_MODEL_NAME, preset: str = "auto", compute_dtype: str = "auto",
               weight_format: str = "auto", kv_cache: str = "auto", max_context: int | None = None,
               progress: Progress | None = None, device: str | torch.device = "auto",
               ram_budget: int | None = None, chat_template: str = "auto", dense_format: str = "auto",
               loras: LoraRequest = (), mmproj: str | Path = "auto") -> A3BModel:
    """Loads a model folder of a supported family (models/), or an embedded demo model, as the preset's placement plan
    says, on `device` ("auto": the first CUDA GPU if there is one; "cpu"; "cuda" or "cuda:N"). The plan may use
    `ram_budget` bytes of RAM (default: what the system reports available). `chat_template` "auto" builds prompts with
    the folder's own chat template when it has one (chat_template.jinja, chat_template.json or tokenizer_config.json's),
    else with the family's built-in one; "built-in" always uses the built-in one (model.chat_template_in_use says
    which). `dense_format` int8 / int4 holds the text model's dense matrices (attention and DeltaNet projections,
    shared experts, lm_head) weight-only quantized when the CPU computes them; "auto" keeps the compute dtype.
    `loras`: LoRA adapters to put on the model, as A3BModel.set_loras takes them. `mmproj` (a .gguf model only): its
    vision tower, "auto" the mmproj*.gguf beside the model file (none there: text only), "none" text only, or the
    path of the mmproj file.

    preset="cpu", compute_dtype="float32" keeps every weight exact and reproduces the reference implementation."""
    started = time.perf_counter()
    if chat_template not in CHAT_TEMPLATES:
        raise ConfigError(f"chat_template {chat_template!r} is not supported; use one of: {', '.join(CHAT_TEMPLATES)} "
                          "(auto: the model folder's own template when it has one; built-in: the pack's own).")
    folder = resolve_model_path(path)
    if str(mmproj) not in MMPROJ_CHOICES and not is_gguf(folder):
        raise ConfigError(f"mmproj {str(mmproj)!r} is for a .gguf model only; {folder} is a model folder, whose "
                          "vision tower is in its own weights. Leave mmproj at 'auto'.")
    gguf = open_gguf(folder, with_template=chat_template == "auto", mmproj=mmproj) if is_gguf(folder) else None
    raw_config = gguf.raw_config if gguf else read_config(folder)
    where_config = str(folder) if gguf else str(folder / "config.json")
    family = family_of(raw_config, where_config)
    # headers only: config.json's layer counts are checked against them before any use
    ckpt = gguf.checkpoint if gguf else Checkpoint(folder)
    # the converted-expert cache is keyed by the files holding the experts: one cache with or without the mmproj
    experts_from = ckpt.text if isinstance(ckpt, GGUFWithVision) else ckpt
    config = family.parse_config(raw_config, where_config, family.stored_layers(ckpt))
    ckpt.fp8_block = config.fp8_block
    tokenizer = gguf.tokenizer if gguf else None
    if not gguf and (folder / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_folder(folder)
    if tokenizer is not None:
        check_against_config(tokenizer, config, where_config)
    folder_template = (gguf.chat_template if gguf else find_chat_template(folder)) if chat_template == "auto" else None
    device = devices.resolve_device(device)
    dtype = resolve_compute_dtype(compute_dtype, device)
    plan = make_plan(config, {n: (i.shape, i.dtype) for n, i in ckpt.infos.items()}, preset,
                     weight_format=weight_format, dense_format=dense_format, kv_cache=kv_cache,
                     max_context=max_context, has_cuda=device.type == "cuda", gpu_free=devices.free_bytes(device),
                     cpu_free=ram_budget,
                     compute_format=FORMAT_OF_DTYPE[dtype])

    def where(plan_device: str) -> torch.device:
        """The plan's device names ("cuda", "cpu") as this load's devices."""
        return device if plan_device == "cuda" else torch.device("cpu")

    def expert_placement(layer: int) -> tuple[str, torch.device]:
        on_gpu = layer in plan.gpu_expert_layers
        return (plan.expert_format_gpu if on_gpu else plan.expert_format_cpu), where("cuda" if on_gpu else "cpu")

    def release_under(prefix: str) -> Callable[[str], None]:
        """Drops the mapped checkpoint pages of a submodule that was copied into a new layout."""
        return lambda name: ckpt.release_under(f"{prefix}{name}.")

    try:
        with torch.device("meta"):
            text = family.text_model(config.text)
        released_dense = plan.dense_format if format_named(plan.dense_format).as_released else None
        text_prefix = family.load_text(text, config.text, ckpt, dtype, progress, expert_placement,
                                       {fmt: expert_cache_dir(experts_from, fmt) for fmt in CONVERTED_FORMATS},
                                       released_dense=released_dense)
        vision, vision_prefix = None, ""
        if plan.vision_device != "none":
            with torch.device("meta"):
                vision = family.vision_tower(config.vision)
            vision_prefix = find_prefix(ckpt, family.vision_probe, family.vision_prefixes, "vision")
            load_module(vision, ckpt, vision_prefix, dtype)
            move(vision.eval(), where(plan.vision_device))
    except (RuntimeError, ValueError) as exc:  # torch refusing a tensor that passed the header checks
        raise CheckpointError(f"{folder}: the weights could not be loaded ({exc}). The files are corrupt or belong "
                              "to another model: download them again.") from exc
    family.place_text(text.eval(), where(plan.dense_device), where(plan.embed_device),
                      {layer: where("cuda") for layer in plan.gpu_expert_layers})
    cpu_swaps.prepare_cpu(text, vision, release_under(text_prefix), release_under(vision_prefix), plan.dense_format)
    stats = LoadStats(seconds=time.perf_counter() - started, tensors=len(ckpt.infos))
    model = A3BModel(folder, config, text, vision, tokenizer, plan, where(plan.dense_device), dtype, stats,
                     folder_template, gguf.template_text if gguf else None)
    model.set_loras(loras)
    return model
