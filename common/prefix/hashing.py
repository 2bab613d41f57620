"""Chained block hashes of token ids, the keys of the fleet-wide prefix index: block ``i`` (``block_size`` =
the KV page size) is hashed with block ``i - 1``'s hash, so a hash names the whole prefix and a lookup stops at
the first miss. blake2b, not Python's per-process salted ``hash``: router and workers must agree.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

__all__ = ["DEFAULT_BLOCK_SIZE", "HASH_BYTES", "chained_block_hashes", "root_hash"]

DEFAULT_BLOCK_SIZE = 16
HASH_BYTES = 8

# Chain root tag: an incompatible scheme change must change it, so a rolling upgrade cannot collide keys.
_ROOT_TAG = b"kvferry/prefix/v1"
_LITTLE_ENDIAN = sys.byteorder == "little"
_blake2b = hashlib.blake2b
_from_bytes = int.from_bytes


def root_hash(seed: int = 0) -> int:
    """The chain's ``h_{-1}`` from ``seed`` (separate hash spaces, e.g. per tokenizer revision)."""
    seed_bytes = (seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    return _from_bytes(_blake2b(_ROOT_TAG + seed_bytes, digest_size=HASH_BYTES).digest(), "little")


def chained_block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    parent: int | None = None,
) -> list[int]:
    """One unsigned 64-bit hash per FULL block of ``token_ids``: ``h_i = blake2b_64(h_{i-1} as 8 LE bytes ||
    block i as LE int32)``, ``h_{-1}`` = ``root_hash(seed)`` or ``parent``. A partial block gets none (its page
    is not reusable whole). OverflowError for a token id outside int32."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    # All full blocks packed in one C call; array('i') is native order, so swapped on big-endian hosts.
    packed = array("i", token_ids[: n_blocks * block_size])
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    buf = memoryview(packed.tobytes())
    step = block_size * 4

    prev = (root_hash(seed) if parent is None else parent & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    out: list[int] = []
    append = out.append
    # The chain is carried as digest bytes: one blake2b per block over two buffers.
    for off in range(0, n_blocks * step, step):
        h = _blake2b(prev, digest_size=HASH_BYTES)
        h.update(buf[off : off + step])
        prev = h.digest()
        append(_from_bytes(prev, "little"))
    return out
