"""The mixed worker: a decode worker that also prefills for peers, made of the prefill and decode plug-ins
(common/worker/roles.py) over one engine.

One engine has both roles (decode_worker/engine.py: local prefill, reservations for a remote prefill, the
running batch; prefill_worker/engine.py: prompts prefilled for a peer's reserved pages and sent over NIXL)
over one scheduler, one KV pool and one NIXL agent. A request a peer asked for is `prefill_only` (parked
once its first token is sampled, released when its transfer ends); every other request joins this
engine's decode batch. The roles share nothing per request: their commands are disjoint, an abort goes to
the prefill role when it holds the request and to the decode role otherwise, and the agent's
notifications are read only by the decode role (the prefill role only sends).

It serves the decode routes (`/internal/generate`, local or remote prefill) and the prefill routes
(`/internal/handshake`, `/internal/prefill`, `/internal/cancel`, `/internal/stats`), so the router can place
each request aggregated on it, disaggregated from it to another decode-capable pod, or disaggregated into
it from a prefill-capable one (router/cost_model.py).
"""
