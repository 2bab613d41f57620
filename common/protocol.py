"""Messages between router and workers, as pydantic models (JSON on the wire, never pickle).

Every top-level message carries `protocol_version`; a receiver refuses versions it does not speak.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

PROTOCOL_VERSION = 1
MAX_TOP_LOGPROBS = 20


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    protocol_version: int = PROTOCOL_VERSION

    @field_validator("protocol_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != PROTOCOL_VERSION:
            raise ValueError(f"unsupported protocol_version {v}; this worker speaks {PROTOCOL_VERSION}")
        return v


class SamplingParams(BaseModel):
    """What decides the next token. Defaults are greedy with no limits."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)  # -1 or 0: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # the sampler hashes it as an int64
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=1024)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class TokenLogprob(BaseModel):
    """Log-probability of the chosen token, and the top-N alternatives (token id -> logprob)."""

    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class GenerateRequest(_Message):
    """Router -> decode worker. `prefill_url` None: the decode worker prefills locally."""

    req_id: str = Field(min_length=1, max_length=128)
    token_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams
    prefill_url: str | None = None


class TokenEvent(BaseModel):
    """One line of the decode worker's NDJSON stream: new tokens, and on the last one a finish reason."""

    model_config = ConfigDict(extra="forbid")
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kv_verified: bool | None = None  # debug mode: page checksums of the transferred KV matched


class KVLayoutInfo(BaseModel):
    """What must match between a prefill and a decode worker before KV moves between them."""

    model_config = ConfigDict(extra="forbid")
    model_id: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout_version: int
    tp_size: int = 1


class HandshakeRequest(_Message):
    """Decode -> prefill: the decode agent's NIXL metadata and KV layout."""

    agent_name: str
    instance_id: str
    agent_metadata_b64: str
    pool_info_b64: str
    layout: KVLayoutInfo


class HandshakeResponse(_Message):
    agent_name: str
    instance_id: str
    layout: KVLayoutInfo


class PrefillRequest(_Message):
    """Decode -> prefill: prefill `token_ids` and WRITE their KV into `dst_pages` of agent `dst_agent`."""

    req_id: str = Field(min_length=1, max_length=128)
    token_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams
    dst_agent: str
    dst_instance_id: str
    dst_pages: list[int]
    deadline_s: float = Field(60.0, gt=0)


class PrefillAccepted(_Message):
    req_id: str
    cached_tokens: int


class AbortRequest(_Message):
    req_id: str


class LoadSnapshot(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    pod: str
    queued_prefill_tokens: int
    running_requests: int
    waiting_requests: int
    free_pages: int
    total_pages: int
    page_size: int
    ready: bool
    draining: bool = False


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
