"""What the executor needs from the model it drives: the `TowerModel` protocol.

Any object with these members works (it is checked structurally, as a
`typing.Protocol`); an engine's multimodal model usually has them already. The
executor calls the encoders with a batch of items of one modality and expects
one packed 2-D tensor back: the items' rows in order, `item.n_tokens` rows each
(post-merge tokens). For deepstack models (`num_deepstack_embeddings > 0`) each
row holds the main embedding and the deepstack levels side by side, and
`separate_deepstack_embeds` splits one item's rows into the two halves that are
shipped (main: `[rows, hidden]`, deepstack: `[rows, hidden * levels]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class TowerModel(Protocol):
    #: deepstack levels per token (0: none, and `separate_deepstack_embeds` is never called)
    num_deepstack_embeddings: int

    def image_encoder(self, items: Sequence[Any]) -> torch.Tensor:
        """Encode a batch of image items; `[sum of n_tokens, width]`. (A CUDA-graph wrapper may replace it.)"""
        ...

    def get_video_feature(self, items: Sequence[Any]) -> torch.Tensor:
        """Encode a batch of video items the same way."""
        ...

    def separate_deepstack_embeds(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Split one item's rows into (main `[rows, hidden]`, deepstack `[rows, hidden * levels]`)."""
        ...
