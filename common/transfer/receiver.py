"""Decode side: learn which requests' KV has landed.

The decode worker never posts transfers: prefill WRITEs into its reserved pages and then sends a
notification (see `RequestTransfer`), so all this side does is drain notifications each loop turn.
"""

from __future__ import annotations

from common.transfer.agent import KVTransferAgent


class KVReceiver:
    def __init__(self, agent: KVTransferAgent) -> None:
        self.agent = agent

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Non-blocking: (peer agent name, message) for every notification since the last call.

        Messages from one peer keep their send order. The payload format (request id, first token)
        belongs to the caller; a peer name alone does not prove the sender's instance, so callers
        match messages against requests they are actually waiting for.
        """
        out: list[tuple[str, bytes]] = []
        for name, messages in self.agent.nixl.get_new_notifs().items():
            peer = name.decode() if isinstance(name, bytes) else str(name)
            out.extend((peer, bytes(m)) for m in messages)
        return out
