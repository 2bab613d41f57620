"""The collector's pauses: counted per collection, and the startup's objects kept out of its walks."""

from __future__ import annotations

import gc

from common.gc_pauses import GcPauses, freeze_startup_objects


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_each_collection_is_counted_with_its_pause_until_uninstalled() -> None:
    pauses = GcPauses().install()
    try:
        for _ in range(3):
            for _ in range(100):
                _Cycle()
            gc.collect()
        assert pauses.count >= 3
        assert 0 < pauses.max_s <= pauses.total_s
    finally:
        pauses.uninstall()
    seen = pauses.count
    gc.collect()
    assert pauses.count == seen


def test_objects_alive_at_freeze_leave_the_collectors_generations() -> None:
    kept = [_Cycle() for _ in range(1000)]
    try:
        frozen = freeze_startup_objects()
        assert frozen >= len(kept)
        assert sum(gc.get_count()) < len(kept)  # the young generations no longer hold them
        for _ in range(10):
            _Cycle()  # garbage made after the freeze is still collected
        assert gc.collect() >= 10
    finally:
        gc.unfreeze()
