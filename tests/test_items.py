"""Items on their way into the ring: refused items, tower errors, modalities, engine item types,
deepstack splitting, and staging (shapes, sizes, lazily negated views). Each bad item fails only its
own room, with its reason, and the extent it leased goes back."""

from __future__ import annotations

import enum
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import Calls, Rig, TableTower, counters, drive, make_rig, reason_kind, reason_text

from epd_ring.executor import (
    EncodeExecutor,
    EncodeItem,
    EncodeManager,
    FakeClock,
    LoopbackTransport,
    Modality,
    item_token_count,
)
from epd_ring.executor.core.reasons import ReasonKind

# -- bad items and tower errors ----------------------------------------------------------------

def test_refused_items_fail_only_their_own_rooms_with_exact_reasons():
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    for rid, room in (("audio", 1), ("bare", 2), ("good", 3)):
        ex.register(rid, "prefill-host", 8998, room)
    m.register_receiver(rig.frame(3, "p3", 2))
    good = rig.item(2, 3)
    batch = [("audio", EncodeItem("audio", 2)),  # a modality the tower lacks
             ("bare", object()),  # no modality at all
             ("good", good),
             ("ghost", EncodeItem("audio", 1)),  # never registered
             (["unhashable"], EncodeItem("audio", 1))]  # cannot even name a request
    assert ex.execute(batch) == 1
    assert reason_kind(m, 1) is ReasonKind.ITEM
    assert reason_kind(m, 2) is ReasonKind.ITEM
    assert m.room_status(3) == "transferring"
    assert ex.poll() == 1  # the one write's outcome
    assert m.room_status(3) == "success" and rig.delivered_ok(3, "p3", good)
    # The refused item was request "audio"'s one item: another is a protocol error,
    # not an item for a room that concluded meanwhile.
    ex.send_item("audio", rig.item(2, 1))
    assert reason_kind(m, 1) is ReasonKind.ITEM
    assert dict(m.stats) == {"items_refused": 4, "items_without_sender": 2, "failed": 2,
                             "success": 1, "told_success": 1}
    # A batch of one takes the same path.
    ex.register("single", "prefill-host", 8998, 4)
    assert ex.execute([("single", object())]) == 0
    assert ex.execute([(["unhashable"], object())]) == 0
    assert reason_kind(m, 4) is ReasonKind.ITEM
    assert (m.stats["items_refused"], m.stats["items_without_sender"]) == (6, 3)


def test_tower_error_without_a_message_is_named_by_its_type():
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    obs = m.observer = Calls("tower_failed")
    for r in (1, 2, 3):
        ex.register(f"r{r}", "prefill-host", 8998, r)
    rig.tower.raise_next = RuntimeError()
    # A request id that cannot be hashed (a tuple holding a list) names no room: the failed batch
    # must still fail the others and return, not raise while it looks that id up.
    batch = [("r1", rig.item(2, 1)), ("r2", rig.item(2, 2)), ("r1", rig.item(2, 1)), ("ghost", rig.item(2, 9)),
             (("bad", ["id"]), rig.item(2, 8))]
    assert ex.execute(batch) == 0
    assert [reason_text(m, r) for r in (1, 2)] == ["RuntimeError", "RuntimeError"]
    assert obs.calls == [("tower_failed", [1, 2, 1])]  # the registered requests' rooms, as batched
    rig.tower.raise_next = ValueError("out of memory")
    assert ex.execute([("r3", rig.item(2, 3))]) == 0
    assert reason_kind(m, 3) is ReasonKind.TOWER
    assert (m.stats["tower_errors"], m.stats["failed"]) == (2, 3)
    # The failed batch spent its requests' one item (an engine reaps them with the others), unlike a
    # request whose item never went to the tower.
    ex.register("r4", "prefill-host", 8998, 4)
    assert [ex.senders[r].offered for r in ("r1", "r2", "r3", "r4")] == [True, True, True, False]


class ReadOnlyItem:
    """An engine item that refuses writes once encoded."""

    modality = "image"
    encoded_deepstack = None

    def __init__(self, encoded):
        object.__setattr__(self, "encoded", encoded)

    def __setattr__(self, name, value):
        raise AttributeError(f"read-only item: {name}")


def test_an_item_that_breaks_the_send_path_fails_only_its_room():
    rig = make_rig(extents=1, extent_bytes=64)  # one 2-row item fills the arena
    ex, m, t = rig.executor, rig.manager, rig.transport
    t.inject("hold", session="p1")
    for r in (1, 2, 3):
        rig.open_room(r)
    ex.execute([("r1", rig.item(2, 1))])
    # Deferring clones the embedding into the item, which this item refuses.
    ex.send_item("r2", ReadOnlyItem(torch.ones(2, 8)))
    assert reason_kind(m, 2) is ReasonKind.ITEM
    ex.send_item(["unhashable"], ReadOnlyItem(torch.ones(2, 8)))
    item3 = rig.item(2, 3)
    assert ex.execute([("r3", item3)]) == 1  # deferred, as the ring is still full
    t.complete(t.held[0])
    ex.poll()
    ex.poll()
    assert m.room_status(3) == "success" and rig.delivered_ok(3, "p3", item3)
    assert counters(m.stats, "items_refused", "items_without_sender", "deferred") == {
        "items_refused": 2, "items_without_sender": 1, "deferred": 1}


# -- modalities and engine item types ----------------------------------------------------------

class PlainTower:
    """A tower with only the encoders: no deepstack attribute, no splitter."""

    def __init__(self, hidden: int = 8, batch_dim: bool = False):
        self.hidden = hidden
        self.batch_dim = batch_dim

    def image_encoder(self, items):
        rows = sum(tokens(i) for i in items)
        out = torch.arange(rows * self.hidden, dtype=torch.float32).reshape(rows, self.hidden)
        return out.unsqueeze(0) if self.batch_dim else out  # some towers keep a batch dimension

    get_video_feature = image_encoder


def tokens(item) -> int:
    """The rows a tower makes for an item: n_tokens, else its inclusive token ranges, else 1."""
    if getattr(item, "n_tokens", None) is not None:
        return item.n_tokens
    return sum(e - s + 1 for s, e in item.offsets) if hasattr(item, "offsets") else 1


def plain_rig(**kw):
    clock = FakeClock()
    transport = LoopbackTransport(clock)
    ex = drive(EncodeExecutor(EncodeManager(transport, clock), PlainTower(**kw), "cpu", ring_slots=2,
                              ring_bytes=4096))
    return Rig(clock, transport, ex.manager, ex, TableTower())


class EngineItem:
    """An engine's own item: token ranges instead of n_tokens (inclusive (start, end))."""

    def __init__(self, modality, offsets):
        self.modality = modality
        self.offsets = offsets
        self.encoded = None
        self.encoded_deepstack = None


def test_engine_items_count_tokens_from_their_offsets():
    rig = plain_rig()
    ex, m = rig.executor, rig.manager
    a = EngineItem("image", [(0, 3), (10, 11)])  # 4 + 2 tokens
    b = EngineItem("video", [(5, 5)])  # 1 token
    for r, n in ((1, 6), (2, 1)):
        rig.open_room(r, rows=n)
    assert ex.execute([("r1", a), ("r2", b)]) == 2
    assert a.encoded.shape == (6, 8) and b.encoded.shape == (1, 8)
    ex.poll()
    assert [m.room_status(r) for r in (1, 2)] == ["success", "success"]


def test_an_item_without_a_token_count_fails_its_batch_naming_its_type():
    rig = plain_rig()
    ex, m = rig.executor, rig.manager

    class Uncounted:
        modality = "image"
        encoded = encoded_deepstack = None

    ex.register("r", "prefill-host", 8998, 1)
    assert ex.execute([("r", Uncounted())]) == 0
    assert reason_kind(m, 1) is ReasonKind.TOWER


class EngineModality(enum.Enum):
    IMAGE = "Image"
    VIDEO = "Video"


def test_modalities_are_matched_by_value_and_case_insensitively():
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    items = {1: EncodeItem(Modality.VIDEO, 2, meta={"seed": 1}), 2: EncodeItem("IMAGE", 2, meta={"seed": 2}),
             3: EncodeItem(Modality.IMAGE, 2, meta={"seed": 3})}
    for r in items:
        ex.register(f"r{r}", "prefill-host", 8998, r)
    assert ex.execute([(f"r{r}", items[r]) for r in items]) == 3
    assert sorted(rig.tower.calls) == [("image", 2), ("video", 1)]
    assert ex.execute([("r9", EncodeItem(Modality.IMAGE, 2, meta={"seed": 9}))]) == 1  # a batch of one
    assert rig.tower.calls[-1] == ("image", 1)

    class Unprintable:
        def __str__(self):
            raise RuntimeError("no name")

        def __repr__(self):
            return "<unprintable>"

    # An engine's own enum (not a str): matched by its value, whatever modality strings
    # this process has seen before.
    ex.register("engine", "prefill-host", 8998, 5)
    assert ex.execute([("engine", EncodeItem(EngineModality.VIDEO, 2, meta={"seed": 5}))]) == 1
    assert rig.tower.calls[-1] == ("video", 1)

    ex.register("odd", "prefill-host", 8998, 4)
    assert ex.execute([("odd", EncodeItem(Unprintable(), 2))]) == 0
    assert reason_kind(m, 4) is ReasonKind.ITEM


def test_a_tower_output_with_a_batch_dimension_is_flattened_to_rows():
    rig = plain_rig(batch_dim=True)
    ex, m = rig.executor, rig.manager
    items = [EncodeItem("image", 2), EncodeItem("image", 3)]
    for r, item in zip((1, 2), items):
        rig.open_room(r, rows=item.n_tokens)
    assert ex.execute([("r1", items[0]), ("r2", items[1])]) == 2
    rows = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    assert torch.equal(items[0].encoded, rows[:2]) and torch.equal(items[1].encoded, rows[2:])
    ex.poll()
    assert [m.room_status(r) for r in (1, 2)] == ["success", "success"]
    assert torch.equal(rig.buffers[(2, "p2")][0], rows[2:])


# -- deepstack ---------------------------------------------------------------------------------

def test_a_model_without_deepstack_needs_no_deepstack_members():
    rig = plain_rig()
    ex, m = rig.executor, rig.manager
    assert ex.ring.deep is None
    rig.open_room(1, rows=3, rid="r")
    item = EncodeItem("image", 3)
    assert ex.execute([("r", item)]) == 1
    assert item.encoded_deepstack is None
    ex.poll()
    assert m.room_status(1) == "success"
    assert torch.equal(rig.buffers[(1, "p1")][0], torch.arange(24, dtype=torch.float32).reshape(3, 8))
    # An item that brings deepstack rows anyway has nowhere to put them.
    ex.register("deep", "prefill-host", 8998, 2)
    ex.send_item("deep", EncodeItem("image", 2, encoded=torch.ones(2, 8), encoded_deepstack=torch.ones(2, 8)))
    assert reason_kind(m, 2) is ReasonKind.ITEM


def test_one_deepstack_level_is_split_off_and_shipped():
    rig = make_rig(n_deep=1)
    ex, m = rig.executor, rig.manager
    rig.open_room(1, rows=3, rid="r")
    item = rig.item(3, 1)
    assert ex.execute([("r", item)]) == 1
    assert item.encoded.shape == (3, 8) and item.encoded_deepstack.shape == (3, 8)
    ex.poll()
    assert m.room_status(1) == "success" and rig.delivered_ok(1, "p1", item)


@pytest.mark.parametrize("n_deep", [1, 2, 3])
@pytest.mark.parametrize("mismatch", ["dtype", "width", "levels"])
def test_deepstack_half_no_receiver_can_take_fails_its_room(n_deep, mismatch):
    # n levels of hidden 8 are 8n float32 columns; another dtype, or a width that is no multiple
    # of hidden, matches no frame's deep_levels; n + 1 whole levels match none of n-level frames.
    # Every level count: with one level, a chunk marked +1 instead of -1 would match the frames.
    deep_width, deep_dtype = {"dtype": (8 * n_deep, torch.float16), "width": (8 * n_deep + 4, torch.float32),
                              "levels": (8 * (n_deep + 1), torch.float32)}[mismatch]
    rig = make_rig(n_deep=n_deep)
    ex, m = rig.executor, rig.manager
    rig.open_room(1, rid="r")
    item = EncodeItem("image", 2, encoded=torch.ones(2, 8),
                      encoded_deepstack=torch.ones(2, deep_width, dtype=deep_dtype))
    ex.send_item("r", item)
    ex.poll()
    assert reason_kind(m, 1) is ReasonKind.FRAME
    assert m.stats["items_refused"] == 0
    assert rig.transport.submitted == 0 and ex.ring.live == 0


def test_zero_width_embedding_fails_on_the_hidden_mismatch():
    rig = make_rig(n_deep=3)
    ex, m = rig.executor, rig.manager
    rig.open_room(1, rid="r")
    item = EncodeItem("image", 2, encoded=torch.ones(2, 0), encoded_deepstack=torch.ones(2, 24))
    ex.send_item("r", item)
    assert reason_kind(m, 1) is ReasonKind.FRAME
    assert m.stats["items_refused"] == 0 and ex.ring.live == 0


# -- staging -----------------------------------------------------------------------------------

def meta_copy_error(shape) -> str:
    """What torch says when asked to copy an embedding that has no data."""
    try:
        torch.empty(shape).copy_(torch.empty(shape, device="meta"))
    except Exception as exc:
        return str(exc)
    raise AssertionError("copying out of a meta tensor is expected to fail")


@pytest.mark.parametrize("half", ["main", "deepstack"])
def test_embedding_without_data_fails_its_room_and_gives_the_extent_back(half):
    rig = make_rig(n_deep=2)
    ex, m = rig.executor, rig.manager
    rig.open_room(1, rid="bad")
    item = rig.item(2, 1)
    item.encoded = torch.zeros(2, 8)
    item.encoded_deepstack = torch.zeros(2, 16)
    if half == "main":
        item.encoded = torch.empty(2, 8, device="meta")
    else:
        item.encoded_deepstack = torch.empty(2, 16, device="meta")
    ex.send_item("bad", item)
    assert reason_kind(m, 1) is ReasonKind.ITEM
    assert ex.ring.live == 0  # the leased extent went back
    assert m.stats["items_refused"] == 0  # handled by staging, not the last line of defence
    # The worker carries on: the next item lands intact.
    rig.open_room(2, rid="next")
    nxt = rig.item(2, 2)
    assert ex.execute([("next", nxt)]) == 1
    ex.poll()
    assert m.room_status(2) == "success" and rig.delivered_ok(2, "p2", nxt)


def test_zero_row_embedding_parks_until_its_deadline_and_frees_its_extent():
    # No frame may declare zero rows, so the chunk waits for receivers that cannot
    # come; its park deadline fails the room and the extent goes back.
    rig = make_rig(park_timeout=10.0)
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1)
    ex.send_item("r", EncodeItem("image", 0, encoded=torch.ones(0, 8)))
    assert m.room_status(1) == "parked" and ex.ring.live == 1
    rig.clock.advance(10.0)
    ex.poll()
    assert m.room_status(1) == "failed" and ex.ring.live == 0
    assert (m.stats["expired"], m.stats["items_refused"]) == (1, 0)


TOO_LARGE = ReasonKind.TOO_LARGE


@pytest.mark.parametrize("encoded, deep, reason", [
    (None, None, "item.encoded must be a 2-D tensor, got NoneType"),
    (torch.ones(8), None, "item.encoded must be a 2-D tensor, got Tensor(8,)"),
    (torch.ones(1, 2, 8), None, "item.encoded must be a 2-D tensor, got Tensor(1, 2, 8)"),
    (torch.ones(129, 8), None, TOO_LARGE),  # 4128 B: over max_item_bytes (ring_bytes)
    (torch.ones(2, 8), torch.ones(3, 24), "deepstack shape (3, 24) does not match 2 rows"),
    (torch.ones(2, 8), torch.ones(2), "deepstack shape (2,) does not match 2 rows"),
    (torch.ones(2, 8), torch.ones(2, 4, 6), "deepstack shape (2, 4, 6) does not match 2 rows"),
    (torch.ones(128, 8), torch.ones(128, 32), TOO_LARGE),  # 16384 B deepstack: over the whole deepstack arena
])
def test_items_that_cannot_be_staged_fail_their_room_with_the_reason(encoded, deep, reason):
    rig = make_rig(extents=1, n_deep=3)  # an arena of 4096 B (128 rows of 8 float32), deepstack 3x that
    ex, m = rig.executor, rig.manager
    ex.register("r", "prefill-host", 8998, 1)
    ex.send_item("r", EncodeItem("image", 2, encoded=encoded, encoded_deepstack=deep))
    assert reason_kind(m, 1) is (reason if reason is TOO_LARGE else ReasonKind.ITEM)
    assert m.stats["items_refused"] == 0 and ex.ring.live == 0


def test_an_embedding_that_fills_its_extents_exactly_is_shipped():
    rig = make_rig(n_deep=3)
    ex, m = rig.executor, rig.manager
    rig.open_room(1, rows=128, rid="r")
    item = rig.item(128, 1)
    assert ex.execute([("r", item)]) == 1  # 128 x 8 x 4 B = 4096 B, deepstack 3x that
    ex.poll()
    assert m.room_status(1) == "success" and rig.delivered_ok(1, "p1", item)


def test_a_lazily_negated_embedding_ships_its_values_not_its_storage():
    # torch keeps some negations as a flag on a view of the same storage; raw bytes would be
    # the un-negated numbers
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    rig.open_room(1, rid="r")
    lazy = torch._neg_view(torch.arange(16.0).reshape(2, 8))
    assert lazy.is_neg() and lazy.is_contiguous()
    ex.send_item("r", EncodeItem("image", 2, encoded=lazy))
    ex.poll()
    assert m.room_status(1) == "success"
    assert torch.equal(rig.buffers[(1, "p1")][0], -torch.arange(16.0).reshape(2, 8))


def test_an_empty_deepstack_half_counts_as_none():
    rig = make_rig()
    ex, m = rig.executor, rig.manager
    rig.open_room(1, rid="r")
    ex.send_item("r", EncodeItem("image", 2, encoded=torch.full((2, 8), 7.0), encoded_deepstack=torch.ones(2, 0)))
    ex.poll()
    assert m.room_status(1) == "success"
    assert torch.equal(rig.buffers[(1, "p1")][0], torch.full((2, 8), 7.0))


def test_an_items_deepstack_half_is_charged_to_its_identity_staged_at_once_or_after_deferral():
    # The shares and a peer's bound count both halves: a deepstack half left out of the cost lets an
    # identity hold more of the arenas than its share says.
    rig = make_rig(extents=1, extent_bytes=64, n_deep=2)
    ex, t = rig.executor, rig.transport
    for session in ("p1", "p2"):
        t.inject("hold", session=session)  # each extent stays leased while its write is held
    for r in (1, 2):
        rig.open_room(r)
    ex.execute([("r1", rig.item(2, 1))])  # 64 B main, 128 B deepstack: staged at once
    ex.execute([("r2", rig.item(2, 2))])  # the arena is full: deferred
    assert ex.has_deferred()
    both = ex.ring.extent_cost(64, 128)
    assert both > ex.ring.extent_cost(64)
    first = rig.extent_of(1)
    assert first.cost == both and first.share.held == both
    t.complete(t.held[0])
    ex.poll()
    ex.poll()  # room 1 concluded and its extent is free: room 2 is served from the deferred queue
    assert rig.manager.room_status(1) == "success"
    assert not ex.has_deferred()
    second = rig.extent_of(2)
    assert second.cost == both and second.share.held == both


@pytest.mark.parametrize("lost", ["encoded", "encoded_deepstack"])
def test_a_deferred_item_that_lost_its_tensors_fails_only_its_room_and_serving_goes_on(lost):
    # The caller owns the item until it is staged: one that drops an attribute while deferred is
    # refused when served (kind `item`), and the sends behind it are still served.
    class Item:
        def __init__(self, seed: float):
            self.encoded = torch.full((2, 8), seed)
            self.encoded_deepstack = None

    rig = make_rig(extents=1, extent_bytes=64)
    ex, m, t = rig.executor, rig.manager, rig.transport
    t.inject("hold", session="p1")
    for r in (1, 2, 3):
        rig.open_room(r)
    ex.execute([("r1", rig.item(2, 1))])
    broken, fine = Item(2.0), Item(3.0)
    ex.send_item("r2", broken)
    ex.send_item("r3", fine)
    assert ex.deferred_requests() == ["r2", "r3"]
    delattr(broken, lost)
    t.complete(t.held[0])
    ex.poll()
    ex.poll()
    assert reason_kind(m, 2) is ReasonKind.ITEM
    assert m.room_status(3) == "success" and not ex.has_deferred()
    assert torch.equal(rig.buffers[(3, "p3")][0], torch.full((2, 8), 3.0))


def test_an_item_with_neither_n_tokens_nor_offsets_has_no_token_count():
    # A public helper for engines: no count is a ValueError, whatever the item lacks.
    class Uncounted:
        modality = "image"

    with pytest.raises(ValueError):
        item_token_count(Uncounted())


@pytest.mark.parametrize("host_copy", [True, False], ids=["host", "device"])
def test_the_device_copy_path_stages_the_same_bytes_as_the_host_path(host_copy):
    # On a GPU the chunk is staged through a typed view of the extent (`copy_`), not `memmove`: the same
    # path runs here on CPU tensors, for the main rows and the deepstack rows, from a plain tensor and
    # from a lazily negated, non-contiguous one.
    rig = make_rig(n_deep=2)
    ex, m = rig.executor, rig.manager
    ex.staging._host_copy = host_copy
    rig.open_room(1, rows=4, rid="r1")
    plain = rig.item(4, 1)
    assert ex.execute([("r1", plain)]) == 1
    ex.poll()
    assert m.room_status(1) == "success" and rig.delivered_ok(1, "p1", plain)
    rig.open_room(2, rows=3, rid="r2")
    main = torch._neg_view(torch.arange(24.0).reshape(3, 8))  # negated: its storage holds the other sign
    deep = torch.arange(3.0 * 16).reshape(16, 3).t()  # 3 x 16, not contiguous
    assert main.is_neg() and not deep.is_contiguous()
    ex.send_item("r2", EncodeItem("image", 3, encoded=main, encoded_deepstack=deep))
    ex.poll()
    assert m.room_status(2) == "success", m.failure_reason(2)
    got_main, got_deep, _, rows = rig.buffers[(2, "p2")]
    assert torch.equal(got_main[:rows], main.resolve_neg()) and torch.equal(got_deep[:rows], deep)


@pytest.mark.parametrize("n_deep", [0, 2])
def test_a_write_carries_a_deepstack_buffer_only_for_an_item_with_deepstack_rows(n_deep):
    # an empty buffer is no part of a write: an engine may refuse a zero-length segment
    rig = make_rig(n_deep=n_deep)
    seen = []
    rig.transport.policy = lambda session, bufs: seen.append([n for _, _, n in bufs])  # sees every write, faults none
    rig.open_room(1, rows=3, rid="r")
    item = rig.item(3, 1)
    assert rig.executor.execute([("r", item)]) == 1
    rig.executor.poll()
    assert rig.manager.room_status(1) == "success" and rig.delivered_ok(1, "p1", item)
    assert seen == [[3 * 8 * 4] + ([3 * 8 * n_deep * 4] if n_deep else [])]
