"""A small real vision tower for the demo and tests: patch embed, blocks, patch merge, deepstack.

Random weights from a fixed seed. Each image of H x W pixels becomes
(H / patch / merge) * (W / patch / merge) tokens after the 2 x 2 spatial merge,
as in Qwen-VL towers; a video is a stack of frames, each encoded the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class TinyVisionTower(nn.Module):
    def __init__(self, *, patch: int = 4, merge: int = 2, width: int = 32, hidden: int = 64,
                 depth: int = 2, deepstack_layers: Sequence[int] = (), seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.patch, self.merge, self.width, self.hidden = patch, merge, width, hidden
        self.patch_embed = nn.Conv2d(3, width, patch, patch)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
        self.deepstack_layers = tuple(deepstack_layers)
        self.merger = nn.Linear(width * merge * merge, hidden)
        self.deep_mergers = nn.ModuleList(nn.Linear(width * merge * merge, hidden) for _ in self.deepstack_layers)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(1, p.shape[-1]) ** 0.5))
        self.eval()

    def tokens_for(self, height: int, width: int) -> int:
        step = self.patch * self.merge
        if height % step or width % step:
            raise ValueError(f"image {height}x{width} is not a multiple of {step} pixels")
        return (height // step) * (width // step)

    def _merge(self, grid: torch.Tensor, proj: nn.Module) -> torch.Tensor:
        # grid: [width, gh, gw] -> [gh/m * gw/m, width*m*m] -> proj
        c, gh, gw = grid.shape
        m = self.merge
        x = grid.reshape(c, gh // m, m, gw // m, m).permute(1, 3, 2, 4, 0).reshape(-1, m * m * c)
        return proj(x)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """[3, H, W] -> [tokens, hidden * (1 + n_deepstack)]"""
        x = self.patch_embed(pixels.unsqueeze(0))[0]  # [width, gh, gw]
        c, gh, gw = x.shape
        seq = x.reshape(c, -1).t()
        deep = []
        for i, block in enumerate(self.blocks):
            seq = seq + block(seq)
            if i in self.deepstack_layers:
                deep.append(self._merge(seq.t().reshape(c, gh, gw), self.deep_mergers[len(deep)]))
        main = self._merge(seq.t().reshape(c, gh, gw), self.merger)
        return torch.cat([main, *deep], dim=1) if deep else main


class TinyVisionModel:
    """The model surface the executor expects: encoders plus the deepstack column split."""

    def __init__(self, tower: TinyVisionTower):
        self.tower = tower
        self.num_deepstack_embeddings = len(tower.deepstack_layers)
        self.hidden = tower.hidden

    def get_image_feature(self, items) -> torch.Tensor:
        return torch.cat([self.tower.encode_image(item.pixel_values) for item in items], dim=0)

    # The seam a CUDA-graph wrapper would replace; eager here.
    image_encoder = get_image_feature

    def get_video_feature(self, items) -> torch.Tensor:
        return torch.cat([self.tower.encode_image(f) for item in items for f in item.pixel_values], dim=0)

    def separate_deepstack_embeds(self, emb: torch.Tensor):
        return emb[:, : self.hidden], emb[:, self.hidden:]
