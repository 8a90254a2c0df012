"""load_model() and A3BModel: the engine contract the nodes, the CLI and the tests use."""
from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import image as image_pipeline
from .cache import Cache
from .checkpoint import Checkpoint
from .config import ModelConfig, load_config
from .errors import CheckpointError, ConfigError, ImageError, PromptError
from .model import TextModel
from .packed import pack_cpu_linears
from .placement import Plan, make_plan
from .positions import mrope_position_ids
from .products import fuse_input_projections
from .prompt import Prompt, Turn, build_prompt
from .tokenizer import Tokenizer
from .vision import VisionTower
from .weights import FORMAT_OF_DTYPE, VISION_PREFIXES, Progress, find_prefix, load_module, load_text_model

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPERT_CACHE_VERSION = 1
DEMO_MODEL_NAME = "a3b-demo"  # load_model's default
DEMO_MODELS = {name: Path(__file__).parent / "demo" / name for name in (DEMO_MODEL_NAME, "a3b-demo-fp8")}


@dataclass
class EncodedImages:
    """Vision-tower output for a list of images, reusable across prompts."""
    embeds: list[torch.Tensor]  # per image [tokens, hidden]
    grids: list[tuple[int, int, int]]  # per image (t, gh, gw) in patches

    def __len__(self) -> int:
        return len(self.embeds)

    def __getitem__(self, index: int | slice) -> "EncodedImages":
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        return EncodedImages(self.embeds[index], self.grids[index])

    def __add__(self, other: "EncodedImages") -> "EncodedImages":
        return EncodedImages(self.embeds + other.embeds, self.grids + other.grids)

    @property
    def token_counts(self) -> list[int]:
        return [e.shape[0] for e in self.embeds]


@dataclass
class LoadStats:
    seconds: float = 0.0
    tensors: int = 0


def resolve_model_path(path: str | Path | None) -> Path:
    """The model folder for `path`: the name of an embedded demo model (None: a3b-demo), else a folder path. Every
    command and load_model name models this way."""
    name = DEMO_MODEL_NAME if path is None else str(path)
    if name in DEMO_MODELS:
        folder = DEMO_MODELS[name]
        if not (folder / "config.json").is_file():
            raise ConfigError(f"the embedded demo model is missing from {folder}; reinstall the pack or pass "
                              "the path of a model folder.")
        return folder
    folder = Path(name).expanduser()
    if not name.strip() or not folder.is_dir():
        raise ConfigError(f"{folder}: model folder not found. Pass the folder that holds config.json and the "
                          f".safetensors files (for example models/LLM/Qwen3.5-35B-A3B), or the name of an "
                          f"embedded demo model ({', '.join(DEMO_MODELS)}).")
    return folder


def resolve_compute_dtype(compute_dtype: str, has_cuda: bool) -> torch.dtype:
    """auto is bf16: on GPUs natively, and on CPUs where it halves the weights read per token (norms, softmaxes
    and the DeltaNet state stay fp32 regardless)."""
    if compute_dtype == "auto":
        return torch.bfloat16
    if compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"compute_dtype {compute_dtype!r} is not supported; use one of: auto, "
                          f"{', '.join(COMPUTE_DTYPES)}.")
    return COMPUTE_DTYPES[compute_dtype]


class A3BModel:
    def __init__(self, folder: Path, config: ModelConfig, text: TextModel, vision: VisionTower | None,
                 tokenizer: Tokenizer | None, plan: Plan, dtype: torch.dtype, load_stats: LoadStats):
        self.folder = folder
        self.config = config
        self.text = text
        self.vision = vision
        self.tokenizer = tokenizer
        self.plan = plan
        self.device = torch.device(plan.dense_device)  # where hidden states live
        self.dtype = dtype
        self.load_stats = load_stats

    @property
    def max_context(self) -> int:
        return self.plan.max_context

    @property
    def kv_dtype(self) -> str | None:
        """The plan's KV cache choice, as generation names it (None: the compute dtype)."""
        return "int8" if self.plan.kv_dtype == "int8" else None

    # ------------------------------------------------------------------------------------------- images
    @torch.inference_mode()
    def encode_images(self, images, size: int = 384, resize: str = "stretch", srgb: bool = True,
                      background: tuple[int, int, int] = (255, 255, 255)) -> EncodedImages:
        """Any images (paths, PIL, arrays, a ComfyUI IMAGE batch) -> vision embeddings, one entry per image."""
        if self.vision is None:
            raise ImageError(f"{self.folder}: this model has no vision tower (config.json has no vision_config or "
                             "the model.visual.* weights are missing); use a vision-language model for images.")
        embeds, grids = [], []
        for img in image_pipeline.images_from_input(images):
            rgb = image_pipeline.load_image(img, background=background, srgb=srgb)
            vcfg = self.config.vision
            pixels, grid = image_pipeline.to_patches(image_pipeline.resize_image(rgb, size, resize), vcfg.patch_size,
                                                     vcfg.temporal_patch_size, vcfg.spatial_merge_size)
            vision_device = self.vision.pos_embed.weight.device
            embeds.append(self.vision(pixels.to(vision_device, self.dtype), [grid]).to(self.device))
            grids.append(grid)
        return EncodedImages(embeds, grids)

    # ------------------------------------------------------------------------------------------- prompts
    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ConfigError(f"{self.folder}: tokenizer.json is missing, so text prompts cannot be built. Copy it "
                              "from the model's release into the folder.")
        return self.tokenizer

    def build_prompt(self, user: str = "", system: str | None = None, images: EncodedImages | None = None,
                     thinking: bool = False, history: Sequence[Turn] = (), add_vision_id: bool = False) -> "ChatPrompt":
        images = images if images is not None else EncodedImages([], [])
        if not isinstance(images, EncodedImages):
            raise PromptError(f"images is a {type(images).__name__}; pass the result of model.encode_images(...), "
                              "which turns pictures into what the model reads.")
        prompt = build_prompt(self.require_tokenizer(), user, system=system, image_token_counts=images.token_counts,
                              thinking=thinking, history=history, add_vision_id=add_vision_id)
        return ChatPrompt(prompt, images)

    # ------------------------------------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor, images: EncodedImages | None) -> torch.Tensor:
        """Token embeddings; with `images`, each image pad token is replaced, in order, by the next image row.
        Without images, pad ids embed as ordinary tokens (a model may generate one)."""
        table = self.text.embed_tokens.weight
        embeds = self.text.embed_tokens(input_ids.to(table.device)).to(self.device)
        if images is None:
            return embeds
        pads = input_ids == self.config.image_token_id
        n_pads, image_rows = int(pads.sum()), sum(images.token_counts)
        if n_pads != image_rows:
            raise PromptError(f"input_ids hold {n_pads} image pad tokens but the images supply {image_rows} "
                              "embedding rows; build prompts with model.build_prompt so pads and images agree.")
        width = {e.shape[-1] for e in images.embeds}
        if width - {embeds.shape[-1]}:
            raise PromptError(f"the encoded images have {sorted(width)} features per token but this model needs "
                              f"{embeds.shape[-1]}: they were encoded by another model. Encode them again with this "
                              "model's encode_images.")
        if n_pads:
            embeds[pads.to(self.device)] = torch.cat(images.embeds).to(embeds.dtype)
        return embeds

    def positions(self, input_ids: torch.Tensor, images: EncodedImages | None,
                  attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """M-RoPE positions [3, B, T] and each row's rope delta; left padding gets position 0."""
        b, t = input_ids.shape
        positions = torch.zeros(3, b, t, dtype=torch.long)
        deltas = []
        grids = list(images.grids) if images is not None else []
        merge = self.config.vision.spatial_merge_size if self.config.vision else 2
        for row in range(b):
            real = attention_mask[row].bool() if attention_mask is not None else torch.ones(t, dtype=torch.bool)
            ids = input_ids[row][real.to(input_ids.device)].cpu()
            n_pads, row_grids = int((ids == self.config.image_token_id).sum()), []
            while n_pads > 0 and grids:
                grid = grids.pop(0)
                row_grids.append(grid)
                n_pads -= grid[0] * (grid[1] // merge) * (grid[2] // merge)
            pos, delta = mrope_position_ids(ids, row_grids, self.config.image_token_id, merge)
            positions[:, row, real] = pos
            deltas.append(delta)
        return positions.to(self.device), deltas

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, images: EncodedImages | None = None, cache: Cache | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        if position_ids is None:
            position_ids, _ = self.positions(input_ids, images, attention_mask)
        mask = attention_mask.to(self.device) if attention_mask is not None else None
        return self.text(self.embed(input_ids, images), position_ids, cache, mask, last_only)

    def logits(self, input_ids: torch.Tensor, images: EncodedImages | None = None,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """LongTensor [B, T] -> float32 logits [B, T, vocab]; no cache is kept."""
        input_ids = check_input_ids(input_ids, self.config.text.vocab_size)
        return self.forward(input_ids, images if images is not None else EncodedImages([], []),
                            attention_mask=attention_mask)

    def new_cache(self, batch: int, max_len: int, kv_dtype: str | None = None) -> Cache:
        return Cache(self.config.text, batch, max_len, self.dtype, self.device, kv_dtype=kv_dtype)

    # ------------------------------------------------------------------------------------------- generation
    def generate(self, prompt, **options) -> "GenerationResult":
        """See a3b_core.generation.generate."""
        from .generation import generate  # generation imports this module
        return generate(self, prompt, **options)

    def generate_batch(self, prompts, **options) -> "list[GenerationResult]":
        """See a3b_core.generation.generate_batch."""
        from .generation import generate_batch
        return generate_batch(self, prompts, **options)

    def release(self) -> None:
        """Drops the weights; the handle cannot be used afterwards (load the model again)."""
        self.text = None
        self.vision = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class ChatPrompt:
    """A built prompt together with the encoded images it refers to."""
    prompt: Prompt
    images: EncodedImages

    @property
    def input_ids(self) -> tuple[int, ...]:
        return self.prompt.input_ids


def check_input_ids(input_ids, vocab_size: int) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.numel() == 0 or ids.dtype in (torch.float16, torch.float32, torch.float64, torch.bool):
        raise PromptError(f"input_ids must be a non-empty integer tensor [batch, tokens]; got shape "
                          f"{tuple(ids.shape)} and dtype {ids.dtype}.")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise PromptError(f"input_ids hold ids outside the vocabulary [0, {vocab_size}); got {int(ids.min())}.."
                          f"{int(ids.max())}. Use the model's own tokenizer.")
    return ids.long()


def expert_cache_dir(ckpt: Checkpoint, fmt: str) -> Path:
    """Where converted experts of this checkpoint are kept: keyed by the weight files' names, sizes and times."""
    root = Path(os.environ.get("A3B_CACHE_DIR", Path.home() / ".cache" / "a3b-nodes")) / "experts"
    key = hashlib.sha256(repr((str(ckpt.folder.resolve()), fmt, EXPERT_CACHE_VERSION, [
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in ckpt.files])).encode()).hexdigest()[:16]
    return root / f"{ckpt.folder.name}-{fmt}-{key}"


def load_model(path: str | Path | None = DEMO_MODEL_NAME, preset: str = "auto", compute_dtype: str = "auto",
               weight_format: str = "auto", kv_cache: str = "auto", max_context: int | None = None,
               progress: Progress | None = None) -> A3BModel:
    """Loads a Qwen3.5/3.6 model folder (or the embedded demo model) as the preset's placement plan says.

    preset="cpu", compute_dtype="float32" keeps every weight exact and reproduces the reference implementation."""
    started = time.perf_counter()
    folder = resolve_model_path(path)
    config = load_config(folder)
    has_cuda = torch.cuda.is_available()
    dtype = resolve_compute_dtype(compute_dtype, has_cuda)
    ckpt = Checkpoint(folder, fp8_block=config.fp8_block)
    plan = make_plan(config, {n: (i.shape, i.dtype) for n, i in ckpt.infos.items()}, preset,
                     weight_format=weight_format, kv_cache=kv_cache, max_context=max_context, has_cuda=has_cuda,
                     compute_format="fp32" if dtype == torch.float32 else "bf16")
    dense = torch.device(plan.dense_device)

    def expert_placement(layer: int) -> tuple[str, torch.device]:
        on_gpu = layer in plan.gpu_expert_layers
        fmt = plan.expert_format_gpu if on_gpu else plan.expert_format_cpu
        return (FORMAT_OF_DTYPE[dtype] if fmt == "bf16" else fmt), torch.device("cuda" if on_gpu else "cpu")

    cache_dirs = {fmt: expert_cache_dir(ckpt, fmt) for fmt in ("int8", "int4")}

    def release_under(prefix: str) -> Callable[[str], None]:
        """Drops the mapped checkpoint pages of a submodule that was copied into a new layout."""
        return lambda name: ckpt.release_under(f"{prefix}{name}.")

    try:
        with torch.device("meta"):
            text = TextModel(config.text)
        text_prefix = load_text_model(text, config.text, ckpt, dtype, progress, expert_placement,
                                      cache_dirs.get(plan.expert_format_cpu), keep_fp8=plan.dense_format == "fp8")
        vision = None
        if plan.vision_device != "none":
            with torch.device("meta"):
                vision = VisionTower(config.vision)
            vision_prefix = find_prefix(ckpt, "pos_embed.weight", VISION_PREFIXES, "vision")
            load_module(vision, ckpt, vision_prefix, dtype)
            vision.eval().to(plan.vision_device)
            pack_cpu_linears(vision, release_under(vision_prefix))
    except (RuntimeError, ValueError) as exc:  # torch refusing a tensor that passed the header checks
        raise CheckpointError(f"{folder}: the weights could not be loaded ({exc}). The files are corrupt or belong "
                              "to another model: download them again.") from exc
    place_text_model(text.eval(), dense, torch.device(plan.embed_device))
    fuse_input_projections(text, release_under(text_prefix))
    tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
    stats = LoadStats(seconds=time.perf_counter() - started, tensors=len(ckpt.infos))
    return A3BModel(folder, config, text, vision, tokenizer, plan, dtype, stats)


def place_text_model(text: TextModel, dense: torch.device, embed: torch.device) -> None:
    """Moves everything to `dense` except the embedding table (to `embed`) and routed experts (already placed)."""
    for layer in text.layers:
        experts = layer.mlp._modules.pop("experts", None)
        layer.to(dense)
        if experts is not None:
            layer.mlp.experts = experts
    text.norm.to(dense)
    text.lm_head.to(dense)
    text.embed_tokens.to(embed)
