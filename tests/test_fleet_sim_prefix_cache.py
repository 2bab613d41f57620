"""The fleet simulator's per-worker prefix cache (bench/fleet_sim/prefix_cache.py) keeps exactly the blocks a
per-block least-recently-used list keeps: each prompt's blocks move to the recent end in the prompt's order and
the oldest leave once it holds more than its room."""

from __future__ import annotations

import random
from collections import OrderedDict

from bench.fleet_sim.prefix_cache import PrefixCache


def _lru_touch(lru: OrderedDict[int, None], blocks: tuple[int, ...], room: int) -> None:
    for b in blocks:
        if b in lru:
            lru.move_to_end(b)
        else:
            lru[b] = None
    while len(lru) > room:
        lru.popitem(last=False)


def test_the_oldest_blocks_leave_first_and_a_used_block_becomes_recent() -> None:
    cache = PrefixCache()
    cache.touch((1, 2, 3), room=4)
    cache.touch((4, 5), room=4)  # 1 is the oldest: it leaves
    assert sorted(cache) == [2, 3, 4, 5]
    cache.touch((2,), room=4)  # 2 becomes the most recent, 3 is now the oldest
    cache.touch((6,), room=4)
    assert sorted(cache) == [2, 4, 5, 6]


def test_a_prompt_longer_than_the_room_keeps_its_last_blocks() -> None:
    cache = PrefixCache()
    cache.touch(tuple(range(10)), room=3)
    assert sorted(cache) == [7, 8, 9]


def test_a_block_used_once_still_leaves_first_after_many_prompts_reuse_others() -> None:
    cache = PrefixCache()
    cache.touch((100,), room=8)
    for i in range(200):  # the same few blocks again and again: their spent touches are dropped from the queue
        cache.touch((i % 3, 3), room=8)
    # 10 blocks for 8 places: 100 (the least recently used), then 2 (last used before 0's and 1's prompts) leave
    cache.touch((10, 11, 12, 13, 14), room=8)
    assert sorted(cache) == [0, 1, 3, 10, 11, 12, 13, 14]


def test_it_keeps_what_a_per_block_lru_list_keeps_over_many_prompts() -> None:
    rng = random.Random(7)
    for _ in range(100):
        room = rng.randint(1, 30)
        lru: OrderedDict[int, None] = OrderedDict()
        cache = PrefixCache()
        # overlapping prompts, many used again: first over fewer ids than the room (nothing leaves, and the spent
        # touches pile up past the queue's compaction threshold), then over more (the oldest leave)
        for i in range(400):
            ids = range(room) if i < 200 else range(i // 10, i // 10 + 2 * room + 12)
            blocks = tuple(rng.sample(ids, min(len(ids), rng.randint(1, 12))))
            _lru_touch(lru, blocks, room)
            cache.touch(blocks, room)
            assert sorted(cache) == sorted(lru)
