"""ForwardPass: a loaded text model driven over token ids, the encoded images' and videos' rows in place of their
pads: rotary positions, generation caches, chunked prefill and decode steps (A3BModel is one)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelReleasedError, PromptError
from ..formats.table import FORMAT_OF_DTYPE, checked_kv_format
from ..models import family_for
from ..release.config import ModelConfig
from .inputs import EncodedImages, check_input_ids
from .placement import Plan


class ForwardPass:
    """The text model of a loaded checkpoint with what drives it: its config, family, memory plan, device and compute
    dtype. `text` is None once the weights are released."""

    def __init__(self, folder: Path, config: ModelConfig, text: torch.nn.Module | None, plan: Plan,
                 device: torch.device, dtype: torch.dtype):
        self.folder = folder
        self.config = config
        self.family = family_for(config.model_type)
        self.text = text
        self.plan = plan
        self.device = device  # where hidden states live: the plan's dense device
        self.dtype = dtype

    @property
    def max_context(self) -> int:
        """The longest sequence the plan holds a cache for."""
        return self.plan.max_context

    @property
    def kv_dtype(self) -> str:
        """The plan's KV cache format (the names are the cache's own)."""
        return self.plan.kv_dtype

    @property
    def max_positions(self) -> int:
        """The positions the model was trained for (config.json's max_position_embeddings)."""
        return self.config.text.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.text.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The end tokens config.json names."""
        return frozenset(self.config.text.eos_token_ids)

    def require_loaded(self) -> None:
        if self.text is None:
            raise ModelReleasedError(f"{self.folder}: this model was released (model.release()), so its weights are "
                                     "gone. Load it again with load_model to use it.")

    def vision_pads(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Where input_ids hold an image or video pad, whose places the vision rows take in order."""
        pad_ids = torch.tensor((self.config.image_token_id, self.config.video_token_id), device=input_ids.device)
        return torch.isin(input_ids, pad_ids)

    def image_rows(self, input_ids: torch.Tensor, images: EncodedImages | None) -> torch.Tensor | None:
        """The images' and videos' rows, one per image or video pad of input_ids (checked), or None without images:
        [n, hidden], or [n, 1 + levels, hidden] for a vision tower with DeepStack."""
        if images is None:
            return None
        n_pads, image_rows = int(self.vision_pads(input_ids).sum()), sum(images.token_counts)
        if n_pads != image_rows:
            raise PromptError(f"input_ids hold {n_pads} image pad tokens but the images supply {image_rows} "
                              "embedding rows; build prompts with model.build_prompt so pads and images agree.")
        hidden, vision = self.config.text.hidden_size, self.config.vision
        levels = len(vision.deepstack_indexes) if vision is not None else 0
        expected = (1 + levels, hidden) if levels else (hidden,)
        shapes = {tuple(e.shape[1:]) for e in images.embeds}
        if shapes - {expected}:
            deepstack = f", {levels} DeepStack levels" if levels else ""
            raise PromptError(f"the encoded images have rows of shape {sorted(shapes)} but this model needs {expected} "
                              f"({hidden} features per token{deepstack}): they were encoded by another model. Encode "
                              "them again with this model's encode_images.")
        return torch.cat(images.embeds) if n_pads else None

    def embed_rows(self, input_ids: torch.Tensor, image_rows: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings [B, T, H] on the model's device, the image pads (row-major) replaced by `image_rows`
        (their first level, with DeepStack)."""
        table = self.text.embed_tokens.weight
        embeds = self.text.embed_tokens(input_ids.to(table.device)).to(self.device)
        if image_rows is not None:
            rows = image_rows[:, 0] if image_rows.dim() == 3 else image_rows
            embeds[self.vision_pads(input_ids).to(self.device)] = rows.to(self.device, embeds.dtype)
        return embeds

    def deepstack(self, input_ids: torch.Tensor,
                  image_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the text model adds after its first layers at the image pads (DeepStack), or None: the pads' indices
        among the B*T tokens [n] (found in RAM, where input_ids are, so the device never reports a count back) and
        the rows' later levels [n, levels, H]."""
        if image_rows is None or image_rows.dim() != 3:
            return None
        pads = self.vision_pads(input_ids.cpu()).flatten().nonzero().squeeze(1)
        return pads.to(self.device), image_rows[:, 1:].to(self.device)

    def run_text(self, input_ids: torch.Tensor, image_rows: torch.Tensor | None, position_ids: torch.Tensor, cache,
                 attention_mask: torch.Tensor | None, last_only: bool) -> torch.Tensor:
        """The text model on input_ids [B, T] with `image_rows` in place of their image pads."""
        return self.text(self.embed_rows(input_ids, image_rows), position_ids, cache, attention_mask, last_only,
                         self.deepstack(input_ids, image_rows))

    def positions(self, input_ids: torch.Tensor, images: EncodedImages | None,
                  attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """Rotary positions [3, B, T] and each row's rope delta; left padding gets position 0. A row's images are
        the next ones in `images` whose tokens its pads hold."""
        b, t = input_ids.shape
        positions = torch.zeros(3, b, t, dtype=torch.long)
        deltas = []
        pending = list(zip(images.grids, images.token_counts)) if images is not None else []
        for row in range(b):
            real = attention_mask[row].bool() if attention_mask is not None else torch.ones(t, dtype=torch.bool)
            ids = input_ids[row][real.to(input_ids.device)].cpu()
            n_pads, row_grids = int(self.vision_pads(ids).sum()), []
            while n_pads > 0 and pending:
                grid, tokens = pending.pop(0)
                row_grids.append(grid)
                n_pads -= tokens
            pos, delta = self.family.positions(self.config, ids, row_grids)
            positions[:, row, real] = pos
            deltas.append(delta)
        return positions.to(self.device), deltas

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, images: EncodedImages | None = None, cache=None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        if position_ids is None:
            position_ids, _ = self.positions(input_ids, images, attention_mask)
        mask = attention_mask.to(self.device) if attention_mask is not None else None
        return self.run_text(input_ids, self.image_rows(input_ids, images), position_ids, cache, mask, last_only)

    def prefill(self, input_ids: torch.Tensor, images: EncodedImages | None, cache,
                attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                chunk: int | None = None) -> torch.Tensor:
        """Runs a prompt batch (input_ids [B, T] in RAM) into `cache`, `chunk` tokens at a time (default: what the
        plan's activation workspace holds); returns the last position's logits [B, V]."""
        pads = self.vision_pads(input_ids)
        image_rows = self.image_rows(input_ids, images)
        per_row = image_rows.split(pads.sum(1).tolist()) if image_rows is not None else ()  # each row's own, in order
        used = [0] * input_ids.shape[0]
        chunk = chunk or self.prefill_chunk(input_ids.shape[0])
        for start in range(0, input_ids.shape[1], chunk):
            end = start + chunk
            rows = None
            counts = pads[:, start:end].sum(1).tolist()
            if per_row and any(counts):
                rows = torch.cat([r[u:u + n] for r, u, n in zip(per_row, used, counts)])
                used = [u + n for u, n in zip(used, counts)]
            mask = attention_mask[:, start:end].to(self.device) if attention_mask is not None else None
            logits = self.run_text(input_ids[:, start:end], rows, position_ids[..., start:end], cache, mask,
                                   last_only=True)
        return logits[:, -1]

    def decode_step(self, tokens: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """One new token per row (`tokens` [B], in RAM) at `position_ids` [3, B, 1], appended to `cache`; returns the
        next logits [B, V]."""
        return self.text(self.embed_rows(tokens[:, None], None), position_ids, cache, None, last_only=True)[:, -1]

    def prefill_chunk(self, rows: int) -> int:
        """Prompt tokens per forward pass for a batch of `rows`: what the plan's activation workspace holds."""
        return self.family.prefill_chunk(self.config, self.plan.workspace_bytes, rows, FORMAT_OF_DTYPE[self.dtype])

    def logits(self, input_ids: torch.Tensor, images: EncodedImages | None = None,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """LongTensor [B, T] -> float32 logits [B, T, vocab]; no cache is kept."""
        self.require_loaded()
        input_ids = check_input_ids(input_ids, self.vocab_size)
        return self.forward(input_ids, images if images is not None else EncodedImages([], []),
                            attention_mask=attention_mask)

    def new_cache(self, batch: int, max_len: int, kv_dtype: str | None = None):
        """The family's generation cache for `batch` sequences of up to `max_len` tokens, on the model's device."""
        return self.family.new_cache(self.config.text, batch, max_len, self.dtype, self.device, kv_dtype=kv_dtype)

    def cache_format(self, kv_dtype: str | None) -> str:
        """The cache format a call uses: the one asked for, else the plan's; "auto" named as the compute format."""
        kv = checked_kv_format(kv_dtype if kv_dtype is not None else self.kv_dtype)
        return FORMAT_OF_DTYPE[self.dtype] if kv == "auto" else kv

    def rows_per_cache(self, tokens: int, kv_format: str) -> int:
        """How many sequences of `tokens` tokens fit at once in what the plan holds for one sequence at its full
        context (per row, keys and values and any recurrent state); at least one."""
        per_row = (self.family.kv_bytes(self.config, tokens, kv_format, FORMAT_OF_DTYPE[self.dtype])
                   + self.family.state_bytes(self.config))
        return max(1, self.plan.cache_bytes // per_row)
