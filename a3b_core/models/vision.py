"""The vision tower of Qwen3.5 and Qwen3-VL: patch embed + learned 2-D position table + axial-RoPE ViT blocks + 2x2
patch merger; Qwen3-VL adds DeepStack, mergers of the outputs of a few middle blocks whose features the text model adds
to the image positions of its first layers.

Parameter names equal the checkpoint's with the "model.visual." prefix removed, so a state dict loads without
renaming. Every layer computes in the dtype of the tensor it is given (parameters are cast on use),
so weights may be stored in one dtype and run in another; norms and rotary math run in fp32.

Patch order: the image processor emits the patches of each image block-major, (block_row, block_col, in_row,
in_col) over spatial_merge_size x spatial_merge_size blocks, so that the merger can take each block as consecutive
rows. Everything indexed by a patch's (row, col) here (position table, rotary angles) is laid out the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError, ImageError
from ..release.config import field, layer_count, positive

LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    out_hidden_size: int = 2048
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    deepstack_indexes: tuple[int, ...] = ()  # blocks whose outputs feed DeepStack, in the order of its levels


def parse_vision_config(vision: dict, where: str, stored_blocks: int | None = None) -> VisionConfig:
    depth = layer_count(vision, "depth", where, stored_blocks, "vision blocks")
    deepstack = field(vision, "deepstack_visual_indexes", where, default=[], types=(list,))
    if (not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth for i in deepstack)
            or len(set(deepstack)) != len(deepstack)):
        raise ConfigError(f"{where}: vision_config.deepstack_visual_indexes is {deepstack!r}; expected distinct block "
                          f"indices from 0 to {depth - 1} (depth {depth}). Use the config.json that came with the "
                          "model.")
    hidden, heads = positive(vision, "hidden_size", where), positive(vision, "num_heads", where)
    if hidden % heads or hidden // heads % 4:
        raise ConfigError(f"{where}: vision_config hidden_size {hidden} / num_heads {heads} must give a whole head size "
                          "divisible by 4 (2-D rotary over half-size pairs). Use the config.json that came with the "
                          "model.")
    positions = positive(vision, "num_position_embeddings", where, default=2304)
    if math.isqrt(positions) ** 2 != positions:
        raise ConfigError(f"{where}: vision_config.num_position_embeddings is {positions}; expected a square number "
                          "(the learned table is a square grid). Use the config.json that came with the model.")
    return VisionConfig(
        depth=depth,
        hidden_size=hidden,
        num_heads=heads,
        intermediate_size=positive(vision, "intermediate_size", where),
        patch_size=positive(vision, "patch_size", where, default=16),
        temporal_patch_size=positive(vision, "temporal_patch_size", where, default=2),
        spatial_merge_size=positive(vision, "spatial_merge_size", where, default=2),
        in_channels=positive(vision, "in_channels", where, default=3),
        num_position_embeddings=positions,
        out_hidden_size=positive(vision, "out_hidden_size", where),
        hidden_act=field(vision, "hidden_act", where, default="gelu_pytorch_tanh", types=str),
        deepstack_indexes=tuple(deepstack),
    )

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


class Linear(nn.Linear):
    """nn.Linear that computes in its input's dtype, whatever dtype its parameters are stored in."""

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in fp32 and returned in the input's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride over one (C, T, p, p) patch; held as Conv3d for the checkpoint's weight
    shape, run as the equivalent matmul because each input row is exactly one patch."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: Tensor) -> Tensor:
        weight = self.proj.weight.reshape(self.proj.out_channels, -1).to(pixel_values.dtype)
        return F.linear(pixel_values, weight, self.proj.bias.to(pixel_values.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, frame_lengths: list[int]) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, heads, head_dim]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Bidirectional attention, restricted to each image (each frame group for video): frames of one size attend
        # as one batch, others one by one.
        if len(set(frame_lengths)) == 1:
            frames = len(frame_lengths)
            q, k, v = (t.view(frames, n // frames, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        else:
            out = torch.cat([
                F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)).transpose(0, 1)
                for qi, ki, vi in zip(q.split(frame_lengths), k.split(frame_lengths), v.split(frame_lengths))])
        return self.proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"config.json: vision_config.hidden_act is '{cfg.hidden_act}'; supported are "
                              f"{', '.join(ACTIVATIONS)}. Use the config.json that came with the model.")
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, frame_lengths: list[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frame_lengths)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """LayerNorm, and each merge x merge block (consecutive rows) -> one LM-sized token. The final merger normalizes
    each patch before merging; DeepStack's mergers (`after_merge`) normalize the merged rows."""

    def __init__(self, cfg: VisionConfig, after_merge: bool = False):
        super().__init__()
        merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.merged, self.after_merge = merged, after_merge
        self.norm = LayerNorm(merged if after_merge else cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = Linear(merged, merged, bias=True)
        self.linear_fc2 = Linear(merged, cfg.out_hidden_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        merged = self.merged
        x = self.norm(x.reshape(-1, merged)) if self.after_merge else self.norm(x).reshape(-1, merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # exact-erf GELU here, unlike the blocks


def rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, heads, head_dim]; cos/sin [N, head_dim] in fp32. Rotates in fp32, returns x's dtype."""
    xf = x.float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def block_major(grid: Tensor, merge: int) -> Tensor:
    """[gh, gw, ...] in raster order -> [gh*gw, ...] in the processor's block-major patch order."""
    gh, gw = grid.shape[:2]
    blocks = grid.reshape(gh // merge, merge, gw // merge, merge, *grid.shape[2:])
    return blocks.transpose(1, 2).reshape(gh * gw, *grid.shape[2:])


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.pos_side = math.isqrt(cfg.num_position_embeddings)  # a square table (parse_vision_config checks)
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg)
        self.deepstack_merger_list = nn.ModuleList(Merger(cfg, after_merge=True) for _ in cfg.deepstack_indexes)

    @property
    def patch_dim(self) -> int:
        return self.cfg.in_channels * self.cfg.temporal_patch_size * self.cfg.patch_size ** 2

    def forward(self, pixel_values: Tensor, grids: list[tuple[int, int, int]]) -> Tensor:
        """pixel_values [N, C*T*p*p] (block-major patches of all images, in order); grids (t, gh, gw) per image.
        Returns [N / merge^2, out_hidden_size] LM-ready embeddings in pixel_values' dtype; with DeepStack,
        [N / merge^2, 1 + levels, out_hidden_size]: the embeddings, then each DeepStack level's features."""
        self._check_inputs(pixel_values, grids)
        grids = [tuple(grid) for grid in grids]
        tables = {grid: self.grid_tables(*grid) for grid in set(grids)}  # one per distinct grid
        pos, cos, sin = (torch.cat(per_image) for per_image in zip(*(tables[grid] for grid in grids)))
        frame_lengths = [gh * gw for t, gh, gw in grids for _ in range(t)]

        x = self.patch_embed(pixel_values) + pos.to(pixel_values.dtype)
        levels = {}
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lengths)
            if index in self.cfg.deepstack_indexes:
                levels[index] = x
        if not levels:
            return self.merger(x)
        features = [merger(levels[i]) for merger, i in zip(self.deepstack_merger_list, self.cfg.deepstack_indexes)]
        return torch.stack([self.merger(x), *features], dim=1)

    def grid_tables(self, t: int, gh: int, gw: int) -> tuple[Tensor, Tensor, Tensor]:
        """For one image grid, in patch order and repeated over t frames: the resampled position embedding
        [t*gh*gw, hidden] and the rotary cos, sin [t*gh*gw, head_dim], all fp32."""
        merge = self.cfg.spatial_merge_size
        table = self.pos_embed.weight.float().T.reshape(1, -1, self.pos_side, self.pos_side)
        resized = F.interpolate(table, size=(gh, gw), mode="bilinear", align_corners=True)[0]  # [hidden, gh, gw]
        pos = block_major(resized.permute(1, 2, 0), merge)

        device = self.pos_embed.weight.device
        # 2-D axial rotary: head_dim/4 frequencies per axis, shared by rows and columns.
        axis_dim = self.cfg.hidden_size // self.cfg.num_heads // 2
        exponents = torch.arange(0, axis_dim, 2, dtype=torch.float32, device=device) / axis_dim
        inv_freq = 1.0 / self.cfg.rope_theta ** exponents
        rows, cols = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
        row_col = block_major(torch.stack((rows, cols), dim=-1), merge).float()  # [gh*gw, 2]
        angles = (row_col[:, :, None] * inv_freq).flatten(1)  # [row angles | col angles]
        angles = torch.cat((angles, angles), dim=-1)
        return pos.repeat(t, 1), angles.cos().repeat(t, 1), angles.sin().repeat(t, 1)

    def _check_inputs(self, pixel_values: Tensor, grids: list[tuple[int, int, int]]) -> None:
        merge = self.cfg.spatial_merge_size
        if not grids:
            raise ImageError("encode_images: no images were given; pass at least one image.")
        for index, (t, gh, gw) in enumerate(grids):
            if min(t, gh, gw) <= 0 or gh % merge or gw % merge:
                raise ImageError(f"image {index}: patch grid (t={t}, h={gh}, w={gw}) is invalid; expected positive "
                                 f"sizes with h and w multiples of {merge}. Preprocess images with a3b_core.media.image.")
        expected = sum(t * gh * gw for t, gh, gw in grids)
        if pixel_values.dim() != 2 or pixel_values.shape != (expected, self.patch_dim):
            raise ImageError(f"pixel_values has shape {tuple(pixel_values.shape)}; the grids {grids} need "
                             f"({expected}, {self.patch_dim}). Preprocess images with a3b_core.media.image.")
