"""Chained block hashes of token ids, the keys of the fleet-wide prefix index.

A prompt is cut into blocks of ``block_size`` tokens (the KV page size, so one hash names one KV page
worth of prefix). Block ``i`` is hashed together with the hash of block ``i - 1``, so a hash names the
whole prefix up to and including its block, not just the block's own tokens: two prompts that share
hash ``h_i`` share every token before it. That is what lets the router look a prompt up block by block
and stop at the first miss.

The router and every worker must compute identical hashes in different processes, on different
machines, so Python's ``hash`` (salted per process by ``PYTHONHASHSEED``) is out; blake2b with an 8-byte
digest is in the standard library, is stable, and is fast enough for short inputs (one call per block).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

__all__ = ["DEFAULT_BLOCK_SIZE", "HASH_BYTES", "chained_block_hashes", "root_hash"]

DEFAULT_BLOCK_SIZE = 16
HASH_BYTES = 8

# Domain-separation string for the chain root: changing the hashing scheme in an incompatible way must
# change this tag, so old and new processes cannot produce colliding keys during a rolling upgrade.
_ROOT_TAG = b"kvferry/prefix/v1"
_LITTLE_ENDIAN = sys.byteorder == "little"
_blake2b = hashlib.blake2b
_from_bytes = int.from_bytes


def root_hash(seed: int = 0) -> int:
    """The chain's ``h_{-1}``: a constant derived from ``seed``.

    The seed lets callers keep separate hash spaces (e.g. per LoRA adapter or per tokenizer revision)
    without changing the key layout; the same seed always gives the same root.
    """
    seed_bytes = (seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    return _from_bytes(_blake2b(_ROOT_TAG + seed_bytes, digest_size=HASH_BYTES).digest(), "little")


def chained_block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Return one unsigned 64-bit hash per FULL block of ``token_ids``.

    ``h_i = blake2b_64(h_{i-1} as 8 little-endian bytes || tokens of block i as little-endian int32)``.
    ``h_{-1}`` is ``root_hash(seed)``, or ``parent`` to continue a chain from an earlier call (then
    ``seed`` is ignored). A trailing partial block gets no hash: its KV page is not full yet, so no
    other request can reuse it as a whole page.

    Raises ``OverflowError`` for a token id outside int32 (no real vocabulary comes near it).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    # Pack all full blocks in one C-level call instead of one struct.pack per block; slicing the
    # resulting bytes per block is cheap. array('i') is native order, so swap on big-endian hosts.
    packed = array("i", token_ids[: n_blocks * block_size])
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    buf = memoryview(packed.tobytes())
    step = block_size * 4

    prev = (root_hash(seed) if parent is None else parent & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    out: list[int] = []
    append = out.append
    # The chain is carried as digest bytes (prev) so each step is one blake2b construction over two
    # buffers; the int conversion is only for the returned values.
    for off in range(0, n_blocks * step, step):
        h = _blake2b(prev, digest_size=HASH_BYTES)
        h.update(buf[off : off + step])
        prev = h.digest()
        append(_from_bytes(prev, "little"))
    return out
