"""The mixed role's engine loop: one engine that decodes, prefills its own requests, and prefills for peers.

A mixed worker is a decode worker (common/serving/decode_host.py: local prefill, reservations for a remote
prefill, the running batch) and a prefill worker (common/serving/prefill_host.py: prompts prefilled for a
peer's reserved pages and sent over NIXL) over one scheduler, one KV pool and one NIXL agent. A request a
peer asked for is `prefill_only` (parked once its first token is sampled, released when its transfer
ends); every other request joins this engine's decode batch. The router chooses per request which of the
three ways to use (router/cost_model.py), so the fleet can run both aggregated and disaggregated at once.

The two roles share nothing per request: their commands are disjoint (both add theirs to `handlers`), `abort` goes to the role holding
the request, and the agent's notifications are read only by the decode side (the prefill side only sends).
"""

from __future__ import annotations

from common.serving.decode_host import DecodeHost
from common.serving.prefill_host import PrefillHost


class MixedHost(DecodeHost, PrefillHost):
    role = "mixed"

    def has_work(self) -> bool:
        return DecodeHost.has_work(self) or PrefillHost.has_work(self)

    def abort(self, req_id: str, reason: str, error: str | None) -> None:
        if req_id in self.outbound:
            PrefillHost.abort(self, req_id, reason, error)
        else:
            DecodeHost.abort(self, req_id, reason, error)

    def tick(self) -> None:
        DecodeHost.tick(self)
        PrefillHost.tick(self)
