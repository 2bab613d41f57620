"""Per-peer KV transfer speed, and a warning when a peer's transfers run at host or network speed.

UCX picks the transport for each peer by itself and says which only in its debug output: two GPU pools on
one node should get cuda_ipc (NVLink, hundreds of GB/s), but a missing shared PID/IPC namespace or an
unreachable peer GPU makes it fall back to TCP or host staging silently (bench/RESULTS.md, "Figures behind
choices in the code"). What the
worker can see is the achieved speed, so it reports that per peer and warns when it is far below NVLink's.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("kvferry.transfer")

MIN_BYTES = 1 << 20  # smaller transfers are dominated by fixed costs: they say nothing of the link
SAMPLES = 8
# GPU to GPU below this is not NVLink: PCIe 5 x16 peer-to-peer moves ~50 GB/s, TCP and host staging a few.
GPU_SLOW_GB_S = 20.0


@dataclass
class PeerLinks:
    gpu: bool  # both ends are GPU pools (host pools move at memory-copy speed whatever the transport)
    speeds: dict[str, deque[float]] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)

    def observe(self, peer: str, nbytes: int, seconds: float) -> float | None:
        """One transfer's bytes and duration; returns the peer's median GB/s over its recent transfers."""
        if nbytes < MIN_BYTES or seconds <= 0:
            return None
        recent = self.speeds.setdefault(peer, deque(maxlen=SAMPLES))
        recent.append(nbytes / seconds / 1e9)
        median = statistics.median(recent)
        if self.gpu and len(recent) >= SAMPLES // 2 and median < GPU_SLOW_GB_S and peer not in self.warned:
            self.warned.add(peer)
            log.warning(
                "KV transfers to %s run at %.1f GB/s (median of %d): not NVLink; UCX likely fell back to TCP "
                "or host staging. Between pods cuda_ipc needs one PID and IPC namespace and the peer GPU "
                "reachable (docs/kubernetes.md); UCX_PROTO_INFO=y shows the protocol chosen",
                peer,
                median,
                len(recent),
            )
        return median
