"""The controller bench's own figures (`epd-ring bench`): per-item counts and interleaved CPU time.

No timing is asserted: only that the call counts are deterministic (the opcodes nearly so) and the
interleaved figures come from both cycles, each checked for the bytes it wrote.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_ring.executor.tools import bench, seed_bench

SEED = Path(__file__).resolve().parents[1].parent / "shared" / "seeds" / "encode_executor.py"


def test_the_per_item_call_counts_are_deterministic_and_count_every_call():
    cycle, check = bench.our_cycle(8, 4)
    first, second = bench.per_item_counts(cycle, 40), bench.per_item_counts(cycle, 40)
    check(2 * (50 + 2 * 40))  # each count warms 50 items, then runs its 40 twice (calls, then opcodes)
    # calls are exact; opcodes allowed a fraction (CI's full run once saw 4,043 against 4,049,
    # before the counts kept the garbage collector out)
    assert (first["calls"], first["builtin_calls"]) == (second["calls"], second["builtin_calls"])
    assert abs(first["opcodes"] - second["opcodes"]) <= 0.02 * first["opcodes"]
    assert 0 < first["calls"] < first["opcodes"] and first["builtin_calls"] > 0


def test_no_garbage_collection_runs_inside_a_count():
    """CI's full run once counted 91.075 calls an item against 91.025: a collection inside the
    window ran the finalizers of objects another test had left (each one Python calls)."""
    import gc

    seen = []

    def cycle(n):
        seen.append((n, gc.isenabled()))

    assert gc.isenabled()
    bench.per_item_counts(cycle, 7)
    assert seen == [(50, True), (7, False), (7, False)] and gc.isenabled()


def test_the_interleaved_figures_come_from_both_cycles_in_alternating_blocks():
    runs = {"a": 0, "b": 0}

    def make(name):
        def cycle(n):
            runs[name] += n
            sum(range(200 * n))  # some CPU time to measure
        return cycle

    figures = bench.interleaved(make("a"), make("b"), blocks=4, block=10)
    assert runs == {"a": 240, "b": 240} and figures["cycled"] == 240
    assert figures["min_ratio"] <= figures["median_ratio"] <= figures["max_ratio"]
    assert figures["ours_us"] > 0 and figures["seed_us"] > 0


@pytest.mark.skipif(not SEED.is_file(), reason=f"no seed at {SEED}")
def test_the_bench_against_the_seed_prints_interleaved_figures_with_and_without_held_rooms():
    lines: list[str] = []
    figures: dict = {}
    bench.run(items=40, sizes=(8,), seed_path=SEED, quiet=True, echo=lines.append, figures=figures)
    # 4 of 8 held and none, an item a turn; 4 held, 4 items a turn; 4 held with ours on the loopback
    assert set(figures["interleaved"]) == {"4 held, 1 a turn", "0 held, 1 a turn", "4 held, 4 a turn",
                                           "4 held, 1 a turn, ours on the loopback"}
    for f in figures["interleaved"].values():
        assert f["ours_us"] > 0 and f["seed_us"] > 0
    assert figures["per_item"]["ours"]["calls"] > 0 and figures["per_item"]["seed"]["calls"] > 0
    assert any("interleaved CPU time" in line for line in lines)
    # both sides checked their receivers' bytes in the cycles the figures rest on
    seed = seed_bench.load_seed(SEED)
    for cycle, check in (bench.our_cycle(8, 8), bench.seed_cycle(seed, 8, 8), bench.our_cycle(8, 4, 4),
                         bench.seed_cycle(seed, 8, 4, 4), bench.our_cycle(8, 4, loopback=True)):
        cycle(5)  # a turn of 4, then one of 1
        check(5)
    with pytest.raises(ValueError, match="batch"):
        bench.our_cycle(8, 4, 5)  # a turn larger than the free extents would defer
