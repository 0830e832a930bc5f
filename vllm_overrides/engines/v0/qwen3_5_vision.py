"""Qwen3.5 / Qwen3.6 vision: the image processor and the vision tower, for the V0 line.

Why our own: the card's transformers 4.51.3 has no ``qwen3_5_moe`` vision model, and its
``Qwen2VLImageProcessor`` drops the checkpoint's ``size`` (it resets ``shortest_edge`` /
``longest_edge`` to Qwen2-VL's 3,136 / 1,003,520 pixels whenever ``size`` is given), so the
token count of every image would differ from the model's own processor.

Image processing (what the checkpoint's ``preprocessor_config.json`` says: patch 16, temporal
patch 2, merge 2, ``size`` = min / max pixels, mean / std): the image is resized (PIL bicubic)
to the nearest size whose sides are multiples of ``patch * merge`` with a pixel count inside
``[min, max]``, rescaled to [0, 1], normalised, repeated ``temporal_patch`` times and cut into
patches ordered by merge block (the ``m x m`` patches that the merger fuses into one token are
consecutive rows). An image of ``h x w`` patches becomes ``h * w / merge**2`` tokens.

The tower (``model.visual.*`` weights): a patch embedding (a Conv3d whose kernel equals its
stride, so a matrix product here), a learned 2-D position table resampled bilinearly
(``align_corners``) to each image's patch grid, ``depth`` pre-norm blocks (LayerNorm, full
bidirectional attention within each image with axial 2-D RoPE on h / w, a GELU-tanh MLP) and the
merger (LayerNorm, ``merge**2`` patches concatenated, two linears with exact GELU) to the
language model's hidden size. The tower is replicated on every tensor-parallel rank (about
0.8 GB in fp16 for the real 27 x 1152 tower): no collective in the image path.

Attention over an image's patches runs in query blocks, so memory stays bounded for the largest
image the processor allows (16,777,216 pixels = 65,536 patches in one sequence).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# Elements of one block of attention scores (float32): bounds the tower's peak memory.
ATTN_SCORE_BUDGET = 1 << 26


# --------------------------------------------------------------------------------------------
# Image processing
# --------------------------------------------------------------------------------------------


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The ``(height, width)`` an image is resized to: sides multiples of ``factor``, pixel count
    within ``[min_pixels, max_pixels]``, aspect ratio kept as closely as that allows. Images
    smaller than ``factor`` are scaled up (as the model's own processor does); an aspect ratio
    above 200 is refused (a ``ValueError``: the request's fault)."""
    if height < 1 or width < 1:
        raise ValueError(f"image of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} is above 200"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


class Qwen3_5ImageProcessor:
    """The checkpoint's image processor settings, applied with PIL and numpy."""

    def __init__(
        self,
        patch_size: int = 16,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        size: dict[str, int] | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        rescale_factor: float = 1 / 255,
        **_: Any,
    ) -> None:
        size = size or {}
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.min_pixels = int(min_pixels or size.get("shortest_edge", 65_536))
        self.max_pixels = int(max_pixels or size.get("longest_edge", 16_777_216))
        self.image_mean = np.asarray(image_mean, dtype=np.float32)
        self.image_std = np.asarray(image_std, dtype=np.float32)
        self.rescale_factor = rescale_factor

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Qwen3_5ImageProcessor:
        path = Path(model_dir) / "preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.exists() else {}
        return cls(**cfg)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def num_tokens(self, height: int, width: int) -> int:
        """Language-model tokens of an image of ``height x width`` pixels."""
        h, w = self.resized_size(height, width)
        return (h // self.factor) * (w // self.factor)

    def max_tokens(self) -> int:
        """Tokens of the largest image this processor produces (a square at max pixels)."""
        side = math.isqrt(self.max_pixels)
        return self.num_tokens(side, side)

    def preprocess(self, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One PIL image -> ``(pixel_values [t*h*w, C*T*P*P] float32, (t, h, w))`` in patches."""
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise ValueError(f"expected an image, got {type(image).__name__}")
        image = image.convert("RGB")
        h, w = self.resized_size(image.height, image.width)
        if (image.height, image.width) != (h, w):
            image = image.resize((w, h), resample=Image.BICUBIC)
        arr = np.asarray(image, dtype=np.float32) * np.float32(self.rescale_factor)
        arr = (arr - self.image_mean) / self.image_std
        return self.patchify(torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1))))

    def patchify(self, chw: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """``[C, H, W]`` -> patches in merge-block order, the frame repeated over time."""
        P, T, m = self.patch_size, self.temporal_patch_size, self.merge_size
        C, H, W = chw.shape
        gh, gw = H // P, W // P
        x = chw.unsqueeze(0).expand(T, C, H, W)
        # [t, T, C, gh/m, m, P, gw/m, m, P] -> [t, gh/m, gw/m, m, m, C, T, P, P]
        x = x.reshape(1, T, C, gh // m, m, P, gw // m, m, P)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(gh * gw, C * T * P * P).contiguous(), (1, gh, gw)


# --------------------------------------------------------------------------------------------
# Vision tower
# --------------------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, segments: list[tuple[int, int]], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, self.head_dim).unbind(1)
        # RoPE in float32 (cos / sin are [N, head_dim]).
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        out = torch.empty_like(q)
        scale = self.head_dim**-0.5
        for start, end in segments:
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, L, d]
            L = end - start
            block = max(1, ATTN_SCORE_BUDGET // (self.num_heads * L))
            for b0 in range(0, L, block):
                scores = torch.matmul(qs[:, b0 : b0 + block], ks.transpose(1, 2)).float() * scale
                probs = scores.softmax(dim=-1).to(vs.dtype)
                out[start + b0 : start + min(L, b0 + block)] = torch.matmul(probs, vs).transpose(
                    0, 1
                )
        return self.proj(out.reshape(N, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, mlp_hidden)

    def forward(
        self, x: torch.Tensor, segments: list[tuple[int, int]], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, dim: int, merge: int, out_dim: int) -> None:
        super().__init__()
        self.merged = dim * merge * merge
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = nn.Linear(self.merged, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3_5VisionTransformer(nn.Module):
    """``model.visual``: pixel patches + grids -> one language-model embedding per token."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        vc = vision_config
        self.hidden = vc.hidden_size
        self.num_heads = vc.num_heads
        self.head_dim = vc.hidden_size // vc.num_heads
        self.merge = vc.spatial_merge_size
        self.patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            vc.in_channels,
            vc.hidden_size,
            kernel_size=(vc.temporal_patch_size, vc.patch_size, vc.patch_size),
            stride=(vc.temporal_patch_size, vc.patch_size, vc.patch_size),
            bias=True,
        )
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.side = math.isqrt(vc.num_position_embeddings)
        rope = getattr(vc, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10_000.0))
        # Axial RoPE: a quarter of head_dim's frequencies for h, the same for w.
        spatial = self.head_dim // 2
        self.register_buffer(
            "inv_freq",
            1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)),
            persistent=False,
        )
        self.blocks = nn.ModuleList(
            VisionBlock(vc.hidden_size, vc.num_heads, vc.intermediate_size) for _ in range(vc.depth)
        )
        self.merger = PatchMerger(vc.hidden_size, self.merge, vc.out_hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def _grid_coords(self, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Row and column of each patch of an ``h x w`` grid, in merge-block order."""
        m = self.merge
        rows = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        cols = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)

    def _pos_embed(self, h: int, w: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The position table resampled bilinearly (corners aligned) at each patch."""
        side = self.side

        def taps(idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            src = idx.float() * (side - 1) / max(n - 1, 1)
            lo = src.floor().long()
            return lo, (lo + 1).clamp(max=side - 1), src - lo.float()

        r0, r1, fr = taps(rows, h)
        c0, c1, fc = taps(cols, w)
        table = self.pos_embed.weight
        out = (
            table[r0 * side + c0] * ((1 - fr) * (1 - fc)).unsqueeze(1).to(table.dtype)
            + table[r0 * side + c1] * ((1 - fr) * fc).unsqueeze(1).to(table.dtype)
            + table[r1 * side + c0] * (fr * (1 - fc)).unsqueeze(1).to(table.dtype)
            + table[r1 * side + c1] * (fr * fc).unsqueeze(1).to(table.dtype)
        )
        return out

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """``pixel_values [sum t*h*w, patch_dim]``, ``grid_thw [n_images, 3]`` ->
        ``[sum t*h*w / merge**2, out_hidden]`` (images in order)."""
        device = pixel_values.device
        w_patch = self.patch_embed.proj.weight.view(self.hidden, -1)
        x = F.linear(pixel_values.to(self.dtype), w_patch, self.patch_embed.proj.bias)
        pos, angles, segments = [], [], []
        offset = 0
        for t, h, w in (tuple(int(v) for v in g) for g in grid_thw):
            rows, cols = self._grid_coords(h, w, device)
            pos.append(self._pos_embed(h, w, rows, cols).repeat(t, 1))
            hw = torch.stack([rows, cols], dim=-1).float()  # [h*w, 2]
            freqs = (hw.unsqueeze(-1) * self.inv_freq).reshape(h * w, -1)  # [h-freqs | w-freqs]
            angles.append(freqs.repeat(t, 1))
            for _ in range(t):  # each frame attends within itself
                segments.append((offset, offset + h * w))
                offset += h * w
        if offset != x.shape[0]:
            raise ValueError(f"grids cover {offset} patches, pixel_values has {x.shape[0]}")
        x = x + torch.cat(pos).to(x.dtype)
        ang = torch.cat(angles)
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos(), ang.sin()
        for blk in self.blocks:
            x = blk(x, segments, cos, sin)
        return self.merger(x)
