"""A worker's latency and transfer histograms, fed from what its engine process reports.

The engine never touches Prometheus: it stamps a request's stages (common/observability/timeline.py) and
sends them with the request's first-token event (decode) or its "done" event (prefill), the achieved
transfer figures with the "done" event, and its decode steps' durations and batch sizes in one "steps"
event per load interval (common/worker/load_report.py). The control plane observes them here, once per
request or per step, never per token.

What each one measures (both workers expose all of them; those of the other role stay empty):

- ``kvferry_request_queue_time_seconds``: the engine had the request until its scheduler took it into a
  prefill batch (local prefill, prefill worker) or, on a decode worker with a prefill peer, until its KV
  pages were reserved.
- ``kvferry_prefill_time_seconds``: scheduler admission to the prompt's first sampled token (all chunks).
- ``kvferry_remote_prefill_seconds`` (decode): page ids sent to the prefill peer until its "KV landed"
  notice was read: the peer's queueing, prefill and transfer as this side waits for them.
- ``kvferry_time_to_first_token_seconds``: the worker received the request until its first event went to
  the HTTP stream (the router's histogram of the same name adds the router's part).
- ``kvferry_decode_step_seconds`` / ``kvferry_decode_batch_size``: one scheduler step that produced decode
  tokens only: its wall time (with overlap on a GPU, the step call that returned its tokens) and requests.
- ``kvferry_kv_transfer_seconds`` / ``_bytes`` (prefill): one request's KV transfer, its first write posted
  until its last write reported complete, and the bytes it moved into the decode pool.
- ``kvferry_kv_transfer_speed_gb_per_s`` (prefill): per write, bytes / (completion seen - posting started),
  in 10^9 bytes/s. The interval starts before the post call and ends when a poll sees completion, so it
  covers the real transfer: the figure can be below the link's speed, never above it. Writes whose
  interval is under a microsecond (nothing to time) are not observed.
- ``kvferry_kv_transfer_tail_seconds`` (prefill): the prompt's first token was sampled until the "landed"
  notice went out: what the transfer adds to TTFT beyond the prefill (chunks posted while later ones
  compute overlap with it).
- ``kvferry_kv_handshake_seconds`` (decode): one handshake round trip with a prefill peer.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram

from common.observability import buckets
from common.observability.timeline import Stamps
from common.worker.link_check import PeerLinks
from common.worker.messages import TransferFigures

__all__ = ["EngineMetrics"]

_MIN_INTERVAL_S = 1e-6


def _between(stamps: Stamps, a: str, b: str) -> float | None:
    if a in stamps and b in stamps:
        return max(0.0, stamps[b] - stamps[a])
    return None


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, gpu: bool = False) -> None:
        r = registry
        self.links: PeerLinks | None = PeerLinks(gpu=gpu)
        self.peer_speed = Gauge(
            "kvferry_kv_peer_speed_gb_per_s",
            "Prefill: median speed of the recent KV transfers (>= 1 MiB) to each decode peer, 10^9 B/s",
            ["peer"],
            registry=r,
        )
        self.queue = Histogram(
            "kvferry_request_queue_time_seconds",
            "Engine received the request until the scheduler admitted it (or reserved its KV pages)",
            buckets=buckets.LATENCY_S,
            registry=r,
        )
        self.prefill = Histogram(
            "kvferry_prefill_time_seconds",
            "Scheduler admission until the prompt's first sampled token",
            buckets=buckets.LATENCY_S,
            registry=r,
        )
        self.remote_prefill = Histogram(
            "kvferry_remote_prefill_seconds",
            "Decode: page ids sent to the prefill peer until its KV-landed notice was read",
            buckets=buckets.LATENCY_S,
            registry=r,
        )
        self.ttft = Histogram(
            "kvferry_time_to_first_token_seconds",
            "Worker received the request until its first event was handed to the HTTP stream",
            buckets=buckets.LATENCY_S,
            registry=r,
        )
        self.step = Histogram(
            "kvferry_decode_step_seconds",
            "Wall time of one scheduler step that produced decode tokens",
            buckets=buckets.STEP_S,
            registry=r,
        )
        self.batch = Histogram(
            "kvferry_decode_batch_size", "Requests in one decode step", buckets=buckets.BATCH, registry=r
        )
        self.transfer = Histogram(
            "kvferry_kv_transfer_seconds",
            "Prefill: one request's KV transfer, first write posted until the last write completed",
            buckets=buckets.LATENCY_S,
            registry=r,
        )
        self.transfer_bytes = Histogram(
            "kvferry_kv_transfer_bytes",
            "Prefill: bytes of one request's KV transfer",
            buckets=buckets.BYTES,
            registry=r,
        )
        self.speed = Histogram(
            "kvferry_kv_transfer_speed_gb_per_s",
            "Prefill: achieved speed of one KV write, bytes / (completion seen - post started), 10^9 B/s",
            buckets=buckets.GBPS,
            registry=r,
        )
        self.tail = Histogram(
            "kvferry_kv_transfer_tail_seconds",
            "Prefill: first token sampled until the KV-landed notice was sent",
            buckets=buckets.LATENCY_S,
            registry=r,
        )
        self.handshake = Histogram(
            "kvferry_kv_handshake_seconds",
            "Decode: one handshake round trip with a prefill peer",
            buckets=buckets.LATENCY_S,
            registry=r,
        )

    # ---- from engine events ----------------------------------------------------------------------
    def observe_decode_timeline(self, stamps: Stamps) -> None:
        """A decode worker's request reached its first token (stamps of every process so far)."""
        remote = "pages_reserved" in stamps
        admitted = "pages_reserved" if remote else "decode_admitted"
        self._observe(self.queue, _between(stamps, "decode_engine_received", admitted))
        if remote:
            self._observe(self.remote_prefill, _between(stamps, "prefill_requested", "kv_landed"))
        else:
            self._observe(self.prefill, _between(stamps, "decode_admitted", "first_token"))
        self._observe(self.ttft, _between(stamps, "decode_received", "first_token_sent"))

    def observe_prefill_done(self, stamps: Stamps, transfer: TransferFigures | None) -> None:
        """A prefill worker's request is done: its KV landed on the decode side."""
        self._observe(self.queue, _between(stamps, "prefill_engine_received", "prefill_admitted"))
        self._observe(self.prefill, _between(stamps, "prefill_admitted", "prefill_first_token"))
        if transfer is None:
            return
        self._observe(self.transfer, transfer.seconds)
        if transfer.seconds is not None and self.links is not None:
            median = self.links.observe(transfer.peer, transfer.bytes, transfer.seconds)
            if median is not None:
                self.peer_speed.labels(peer=transfer.peer).set(median)
        self._observe(self.tail, transfer.tail)
        self.transfer_bytes.observe(transfer.bytes)
        for nbytes, seconds in transfer.writes:
            if nbytes > 0 and seconds >= _MIN_INTERVAL_S:
                self.speed.observe(nbytes / seconds / 1e9)

    def observe_steps(self, flat: list[float]) -> None:
        """[seconds, batch size, seconds, batch size, ...] of the decode steps since the last report."""
        for i in range(0, len(flat) - 1, 2):
            self.step.observe(flat[i])
            self.batch.observe(flat[i + 1])

    @staticmethod
    def _observe(h: Histogram, value: float | None) -> None:
        if value is not None:
            h.observe(value)
