"""The KV layout both ends of a transfer exchange, checked in the handshake: pages move as raw bytes at computed
addresses, so a mismatch would write garbage silently rather than fail.
"""

from __future__ import annotations

from common.kv.pool import KVPool
from common.protocol import KVLayoutInfo, to_builtins

# Bump when a pool's byte meaning changes: peers that disagree refuse each other even if every shape matches.
LAYOUT_VERSION = 2  # 2: page-major pool


class LayoutMismatch(ValueError):
    def __init__(self, fields: dict[str, tuple[object, object]]) -> None:
        self.fields = fields
        detail = ", ".join(f"{name}: local={lo!r} remote={re!r}" for name, (lo, re) in fields.items())
        hint = ""
        if "dtype" in fields or "kv_scales" in fields:
            hint = "; the KV format (KVFERRY_DTYPE, KVFERRY_KV_DTYPE, the checkpoint's KV scales) must match on both workers"
        super().__init__(f"KV layout mismatch ({detail}){hint}")


def dtype_name(dtype: object) -> str:
    """`torch.bfloat16` -> `"bfloat16"`: a torch-version-independent wire spelling."""
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


# Fields the ends may differ in (the head split is matched per rank by common/transfer/routes.py).
MAY_DIFFER = frozenset({"tp_size"})


def check_compatible(local: KVLayoutInfo, remote: KVLayoutInfo) -> None:
    """Raises `LayoutMismatch` naming every differing field at once."""
    lo, re = to_builtins(local), to_builtins(remote)
    diff = {name: (lo[name], re.get(name)) for name in lo if lo[name] != re.get(name) and name not in MAY_DIFFER}
    if diff:
        raise LayoutMismatch(diff)
