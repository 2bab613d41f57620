"""The KV layout descriptor both ends of a transfer exchange, and the check that they agree.

Pages are moved as raw bytes at computed addresses, so any difference in shape, dtype or model would
not fail loudly: it would silently write garbage into the decode pool. The check runs in the handshake,
before any remote metadata is loaded.
"""

from __future__ import annotations

from common.kv.pool import KVPool
from common.protocol import KVLayoutInfo, to_builtins

# Bump when the byte meaning of a pool changes (axis order, K/V interleave, page addressing): peers
# that disagree must refuse each other even if every shape field happens to match.
LAYOUT_VERSION = 2  # 2: page-major pool


class LayoutMismatch(ValueError):
    """Two KV layouts cannot exchange pages; `fields` names every field that differs."""

    def __init__(self, fields: dict[str, tuple[object, object]]) -> None:
        self.fields = fields
        detail = ", ".join(f"{name}: local={lo!r} remote={re!r}" for name, (lo, re) in fields.items())
        hint = ""
        if "dtype" in fields or "kv_scales" in fields:
            hint = "; the KV format (KVFERRY_DTYPE, KVFERRY_KV_DTYPE, the checkpoint's KV scales) must match on both workers"
        super().__init__(f"KV layout mismatch ({detail}){hint}")


def dtype_name(dtype: object) -> str:
    """`torch.bfloat16` -> `"bfloat16"`: a stable, torch-version-independent wire spelling."""
    return str(dtype).removeprefix("torch.")


def layout_info(pool: KVPool, model_id: str, tp_size: int = 1, num_kv_heads: int | None = None) -> KVLayoutInfo:
    """`num_kv_heads`: the model's KV heads (under tensor parallelism `pool` holds only rank 0's)."""
    layout = pool.layout
    return KVLayoutInfo(
        model_id=model_id,
        dtype=dtype_name(layout.dtype),
        page_size=layout.page_size,
        num_layers=layout.num_layers,
        num_kv_heads=num_kv_heads or layout.num_kv_heads,
        head_dim=layout.head_dim,
        layout_version=LAYOUT_VERSION,
        tp_size=tp_size,
        kv_scales=list(layout.kv_scales),
        kv_parts=layout.kv_parts,
    )


# Fields the two ends may differ in: how each splits the heads over its ranks is matched per rank by
# `common/transfer/routes.py`.
MAY_DIFFER = frozenset({"tp_size"})


def check_compatible(local: KVLayoutInfo, remote: KVLayoutInfo) -> None:
    """Raise `LayoutMismatch` naming every differing field (all of them, so one round trip tells all)."""
    lo, re = to_builtins(local), to_builtins(remote)
    diff = {name: (lo[name], re.get(name)) for name in lo if lo[name] != re.get(name) and name not in MAY_DIFFER}
    if diff:
        raise LayoutMismatch(diff)
