"""Qwen3-VL split across encode and prefill: the tower as the executor's model, and prefill on what arrived.

Encode side: `Qwen3VLTower` gives the executor the surface it drives
(`image_encoder`, `get_video_feature`, `num_deepstack_embeddings`,
`separate_deepstack_embeds`). Each item's rows leave as [rows, H] on the main
ring and [rows, L*H] on the deepstack ring (level-major columns).

Prefill side: `Prompt` is the prefill request as the engine's scheduler holds it
(token ids and, per multimodal item, its modality, `grid_thw` and room). Where
it lives, and why: `grid_thw` is produced by the processor before encoding
starts, and engines route it to prefill with the request (the prompt's
placeholder tokens are laid out from it), so it needs no new wire field. The
wire binds what the bytes are (the frame's span, hidden, dtype and deepstack
levels are checked against the chunk on the encode side before any write), and
`assemble` checks on arrival that the bytes fit the request: rows equal
t*h*w/merge^2 and the prompt's placeholder run for that item, width and dtype
equal the model's, deepstack width equals levels*H. A mismatch fails the
request with a reason, never a silently shifted scatter.

Only `hf.py` touches transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from epd_ring.executor import EncodeItem

from . import hf

MODELS = ("qwen3-vl-tiny",)


class ArrivalError(ValueError):
    """What arrived does not fit the prefill request; fails only that request."""


# -- encode side ----------------------------------------------------------------------------
class Qwen3VLTower:
    """The executor's model surface over a Qwen3-VL vision tower.

    Items carry their packed patches in `pixel_values` and their grid in
    `meta["grid_thw"]`; a batch is one tower call (attention stays within each
    item, so an item's rows are the same batched or alone).
    """

    def __init__(self, model: Any):
        self.model = model
        self.spec = hf.spec(model)
        self.hidden = self.spec.hidden
        self.num_deepstack_embeddings = self.spec.levels

    def get_image_feature(self, items: Sequence[EncodeItem]) -> torch.Tensor:
        pv = torch.cat([i.pixel_values for i in items]) if len(items) > 1 else items[0].pixel_values
        grid = torch.tensor([list(i.meta["grid_thw"]) for i in items], dtype=torch.long)
        main, deep = hf.encode(self.model, pv, grid)
        return torch.cat([main, *deep], dim=1)

    # The seam a CUDA-graph wrapper would replace; eager here.
    image_encoder = get_image_feature
    # Video goes through the same tower (Qwen3-VL encodes frames in temporal patches).
    get_video_feature = get_image_feature

    def separate_deepstack_embeds(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return emb[:, :self.hidden], emb[:, self.hidden:]


def rows_of(grid_thw: Sequence[int], merge: int) -> int:
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (merge * merge)


def patchify_video(frames: np.ndarray, s: hf.Spec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[T, H, W, 3] uint8 frames -> (patches [t*h*w, 3*Tp*P*P], grid_thw), in the processor's layout.

    H and W must be multiples of patch*merge and T of the temporal patch
    (the demo generates them so; a real engine resizes with its processor).
    """
    T, H, W, C = frames.shape
    p, m, tp = s.patch, s.merge, s.temporal_patch
    if T % tp or H % (p * m) or W % (p * m):
        raise ValueError(f"video {T}x{H}x{W} is not a multiple of {tp} frames and {p * m} pixels")
    x = torch.from_numpy(frames).float().div(255).sub(0.5).div(0.5).permute(0, 3, 1, 2)  # T, C, H, W
    gt, gh, gw = T // tp, H // p, W // p
    x = x.reshape(gt, tp, C, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, C * tp * p * p).contiguous(), (gt, gh, gw)


# -- the prefill request ----------------------------------------------------------------------
@dataclass
class MMItem:
    """One image or video of a request, as prefill knows it before any byte arrives."""

    modality: str  # "image" or "video"
    grid_thw: tuple[int, int, int]
    room: int = -1
    pixel_values: torch.Tensor | None = None  # encode side (and the monolithic reference) only

    def rows(self, merge: int) -> int:
        return rows_of(self.grid_thw, merge)

    def meta(self) -> dict:
        return {"modality": self.modality, "grid_thw": list(self.grid_thw), "room": self.room}

    def encode_item(self, merge: int) -> EncodeItem:
        return EncodeItem(self.modality, self.rows(merge), pixel_values=self.pixel_values,
                          meta={"grid_thw": self.grid_thw})


@dataclass
class Prompt:
    """A prefill request: token ids with placeholder runs, and its items in prompt order."""

    input_ids: torch.Tensor  # [1, S]
    items: list[MMItem]
    spans: list[tuple[int, int]] = field(default_factory=list)  # placeholder positions of each item

    def mm_token_type_ids(self, s: hf.Spec) -> torch.Tensor:
        ids = self.input_ids
        return (ids == s.image_token).int() + 2 * (ids == s.video_token).int()

    def grids(self, modality: str) -> torch.Tensor | None:
        g = [list(i.grid_thw) for i in self.items if i.modality == modality]
        return torch.tensor(g, dtype=torch.long) if g else None

    def meta(self) -> dict:
        return {"input_ids": self.input_ids[0].tolist(), "items": [i.meta() for i in self.items]}

    @classmethod
    def from_meta(cls, meta: dict, s: hf.Spec) -> Prompt:
        """A request received as metadata; each item's grid is checked against its placeholder run."""
        try:
            items = [MMItem(str(i["modality"]), _grid(i["grid_thw"]), int(i["room"])) for i in meta["items"]]
            ids = torch.tensor([meta["input_ids"]], dtype=torch.long)
        except (KeyError, TypeError, ValueError) as exc:
            raise ArrivalError(f"malformed prefill request: {exc!r}") from None
        p = cls(ids, items)
        p.spans = placeholder_spans(p, s)
        return p


def _grid(g: Any) -> tuple[int, int, int]:
    if not isinstance(g, (list, tuple)) or len(g) != 3 or not all(isinstance(x, int) and x > 0 for x in g):
        raise ValueError(f"grid_thw must be three positive integers, got {g!r}")
    return (g[0], g[1], g[2])


def build_prompt(s: hf.Spec, items: list[MMItem], rng: np.random.Generator, text_len: int = 6) -> Prompt:
    """Text, then each item's placeholder run between vision start/end, then text.

    A video's temporal groups are separated by text (the timestamps Qwen3-VL
    puts between frame groups), which is what its rope index expects.
    """
    def text(n: int) -> list[int]:
        return rng.integers(1, s.image_token, n).tolist()

    ids = text(text_len)
    spans = []
    for it in items:
        t = it.grid_thw[0]
        token = s.image_token if it.modality == "image" else s.video_token
        groups = t if it.modality == "video" else 1
        per = it.rows(s.merge) // groups
        start = None
        for _ in range(groups):
            if it.modality == "video":
                ids += text(2)  # the frame group's timestamp
            ids.append(s.vision_start)
            if start is None:
                start = len(ids)
            ids += [token] * per
            ids.append(s.vision_end)
        spans.append((start, len(ids) - 1))
        ids += text(3)
    p = Prompt(torch.tensor([ids], dtype=torch.long), items)
    p.spans = placeholder_spans(p, s)
    return p


def placeholder_spans(p: Prompt, s: hf.Spec) -> list[tuple[int, int]]:
    """Per item, the (first, last+1) positions of its placeholders; ArrivalError if they do not fit the grids."""
    ids = p.input_ids[0]
    spans = []
    for modality, token in (("image", s.image_token), ("video", s.video_token)):
        pos = (ids == token).nonzero().flatten().tolist()
        k = 0
        for idx, it in enumerate(p.items):
            if it.modality != modality:
                continue
            if it.grid_thw[1] % s.merge or it.grid_thw[2] % s.merge:
                raise ArrivalError(f"item {idx}: grid_thw {it.grid_thw} is not a multiple of the "
                                   f"{s.merge}x{s.merge} merge")
            n = it.rows(s.merge)
            if k + n > len(pos):
                raise ArrivalError(f"item {idx} ({modality}, grid {it.grid_thw}) needs {n} placeholders, "
                                   f"the prompt has {len(pos) - k} left")
            spans.append((idx, pos[k], pos[k + n - 1] + 1))
            k += n
        if k != len(pos):
            raise ArrivalError(f"the prompt has {len(pos)} {modality} placeholders, its grids account for {k}")
    if any(it.modality not in ("image", "video") for it in p.items):
        raise ArrivalError("item modality must be 'image' or 'video'")
    return [(a, b) for _, a, b in sorted(spans)]


# -- prefill on what arrived ------------------------------------------------------------------
def check_arrival(s: hf.Spec, p: Prompt, received: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
                  dtype: torch.dtype) -> None:
    """Each item's received rows fit its grid, the model's width and dtype, and its deepstack levels."""
    if len(received) != len(p.items):
        raise ArrivalError(f"{len(received)} items arrived for a request of {len(p.items)}")
    for idx, (it, (main, deep)) in enumerate(zip(p.items, received, strict=True)):
        want = it.rows(s.merge)
        where = f"item {idx} (room {it.room}, {it.modality}, grid_thw {tuple(it.grid_thw)})"
        if main.dtype != dtype or (deep is not None and deep.dtype != dtype):
            raise ArrivalError(f"{where}: rows arrived as {main.dtype}, the model runs in {dtype}")
        if tuple(main.shape) != (want, s.hidden):
            raise ArrivalError(f"{where}: expected [{want}, {s.hidden}] rows from its grid, got {list(main.shape)}")
        if s.levels and (deep is None or tuple(deep.shape) != (want, s.levels * s.hidden)):
            raise ArrivalError(f"{where}: expected {s.levels} deepstack levels [{want}, {s.levels * s.hidden}], "
                               f"got {None if deep is None else list(deep.shape)}")


def prefill(model: Any, p: Prompt, received: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
            new_tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The language model on the received rows: (prefill logits [1, S, V], greedy tokens [new_tokens])."""
    s = hf.spec(model)
    dtype = model.lm_head.weight.dtype
    check_arrival(s, p, received, dtype)
    if not p.spans:
        p.spans = placeholder_spans(p, s)
    ids = p.input_ids
    embeds = hf.embed_tokens(model, ids)
    visual = torch.zeros_like(ids, dtype=torch.bool)
    for (start, end), (main, _) in zip(p.spans, received, strict=True):
        # A video's run includes its timestamp text between groups: write only placeholders.
        mask = (ids[0, start:end] == s.image_token) | (ids[0, start:end] == s.video_token)
        embeds[0, start:end][mask] = main
        visual[0, start:end] = mask
    deepstack = None
    if s.levels:
        # Rows in prompt order = the monolithic model's joint image/video deepstack order.
        joint = torch.cat([deep for _, deep in received]) if len(received) > 1 else received[0][1]
        deepstack = [joint[:, k * s.hidden:(k + 1) * s.hidden] for k in range(s.levels)]
    pos, delta = hf.rope_index(model, ids, p.mm_token_type_ids(s), p.grids("image"), p.grids("video"))
    logits, cache = hf.language_model(model, embeds, pos, hf.new_cache(model), visual, deepstack)
    tokens = [logits[0, -1].argmax()]
    for _ in range(new_tokens - 1):
        step, cache = hf.decode_step(model, tokens[-1], cache, delta)
        tokens.append(step[0, -1].argmax())
    return logits, torch.stack(tokens)


def monolithic(model: Any, p: Prompt, new_tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsplit model on the same request, from pixels."""
    s = hf.spec(model)
    imgs = [i.pixel_values for i in p.items if i.modality == "image"]
    vids = [i.pixel_values for i in p.items if i.modality == "video"]
    return hf.monolithic(model, p.input_ids, p.mm_token_type_ids(s),
                         pixel_values=torch.cat(imgs) if imgs else None, image_grid_thw=p.grids("image"),
                         pixel_values_videos=torch.cat(vids) if vids else None, video_grid_thw=p.grids("video"),
                         new_tokens=new_tokens)


# -- a prefill worker over any receiver ---------------------------------------------------------
@dataclass
class Placement:
    """Which prefill worker takes which rows of a request's items: all of them, or a shard."""

    rank: int = 0
    n: int = 1  # receivers per room
    shard: bool = False


class PrefillWorker:
    """Registers a request's rooms on a receiver, then runs prefill on what arrived.

    `receiver` is the reference receiver (or anything with its `expect`,
    `register`, `result` and a `status` dict of room -> statuses told).
    """

    def __init__(self, model: Any, receiver: Any):
        self.model = model
        self.spec = hf.spec(model)
        self.receiver = receiver
        self.requests: dict[str, tuple[Prompt, Placement]] = {}

    def accept(self, rid: str, meta: dict, place: Placement, *, register: bool = True) -> None:
        """Take a request's metadata and register a frame per item (ArrivalError if the prompt does not fit it)."""
        p = Prompt.from_meta(meta, self.spec)
        s = self.spec
        for it in p.items:
            self.receiver.expect(it.room, span=it.rows(s.merge), hidden=s.hidden, deep_width=s.levels * s.hidden,
                                 n=place.n, rank=place.rank, shard=place.shard)
            if register:
                self.receiver.register(it.room)
        self.requests[rid] = (p, place)

    def outcome(self, rid: str) -> str | None:
        """'success' once every room of the request succeeded, 'failed' once any failed, else None."""
        p, _ = self.requests[rid]
        told = [self.receiver.status.get(it.room, []) for it in p.items]
        if any("failed" in t for t in told):
            return "failed"
        return "success" if all("success" in t for t in told) else None

    def failure(self, rid: str) -> str:
        p, _ = self.requests[rid]
        bad = [it.room for it in p.items if "success" not in self.receiver.status.get(it.room, [])]
        return f"rooms {bad} were not delivered"

    def rows(self, rid: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The received rows of each item (this worker's shard of them, when sharded)."""
        p, _ = self.requests[rid]
        return [self.receiver.result(it.room) for it in p.items]

    def run(self, rid: str, peer_rows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor | None]]] = (),
            new_tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill on the received rows; a sharded request joins the peers' shards first (rank order)."""
        p, place = self.requests[rid]
        mine = self.rows(rid)
        if place.shard:
            parts = [mine, *peer_rows]
            if len(parts) != place.n:
                raise ArrivalError(f"request {rid}: {len(parts)} of {place.n} shards present")
            mine = [(torch.cat([r[k][0] for r in parts]),
                     torch.cat([r[k][1] for r in parts]) if parts[0][k][1] is not None else None)
                    for k in range(len(p.items))]
        with torch.inference_mode():
            return prefill(self.model, p, mine, new_tokens)

    def forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
