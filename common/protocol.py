"""Messages between router and workers, as pydantic models (JSON on the wire, never pickle).

Every top-level message carries `protocol_version`; a receiver refuses versions it does not speak.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PROTOCOL_VERSION = 1
MAX_TOP_LOGPROBS = 20
FinishReason = Literal["stop", "length", "abort", "error"]  # why a worker ended a request


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    protocol_version: int = PROTOCOL_VERSION

    @field_validator("protocol_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != PROTOCOL_VERSION:
            raise ValueError(f"unsupported protocol_version {v}; this worker speaks {PROTOCOL_VERSION}")
        return v


MAX_LOGIT_BIAS = 2048  # entries in one request's logit_bias map
MAX_GRAMMAR_CHARS = 256 * 1024


class GrammarSpec(BaseModel):
    """A constraint on the whole output, compiled by the worker that samples (common/sched/grammar.py):
    a JSON schema (text), any JSON object, a regular expression, or an EBNF grammar (xgrammar's dialect).
    The spec travels, never compiled state: each worker compiles it (cached per spec) and replays the
    tokens sampled before it took over."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["json_schema", "json_object", "regex", "ebnf"]
    value: str = Field("", max_length=MAX_GRAMMAR_CHARS)


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
    # Added to the logits before any other step (token id -> bias); -100 bans a token, +100 all but forces it.
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)  # over prompt and output tokens; 1 = off
    min_tokens: int = Field(0, ge=0)  # EOS and stop_token_ids are masked until this many tokens are out
    grammar: GrammarSpec | None = None
    # A request continued on another worker (router/migration.py): the last `output_offset` prompt tokens are
    # its own earlier output. The sampler counts them as output positions (a seeded draw at output position k
    # is the same on every worker) and the penalties as output tokens.
    output_offset: int = Field(0, ge=0)
    # The request's SLO class (common/slo.py; "" = the deployment's default), which the router chose from its
    # `priority` or `x-kvferry-class`: its queue deadline and the ITL target of the steps that decode it.
    slo_class: str = Field("", max_length=64)

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v: dict[int, float]) -> dict[int, float]:
        for token, bias in v.items():
            if token < 0:
                raise ValueError(f"logit_bias token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias value {bias} for token {token} is outside [-100, 100]")
        return v

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
    # Deadline for the remote prefill and its KV transfer (None: the decode worker's default, 60 s); the prefill
    # worker gets the same deadline for its writes.
    kv_timeout_s: float | None = Field(None, gt=0, le=3600)

    @model_validator(mode="after")
    def _offset_in_prompt(self) -> GenerateRequest:
        _check_output_offset(self.sampling, self.token_ids)
        return self


def _check_output_offset(sampling: SamplingParams, token_ids: list[int]) -> None:
    if sampling.output_offset >= len(token_ids):
        raise ValueError("sampling.output_offset must be shorter than the prompt")


class TokenEvent(BaseModel):
    """One line of the decode worker's NDJSON stream: new tokens, and on the last one a finish reason."""

    model_config = ConfigDict(extra="forbid")
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kv_verified: bool | None = None  # debug mode: page checksums of the transferred KV matched
    retryable: bool = False  # with "error": the worker lost its engine; the request may continue elsewhere


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
    kv_scales: list[float] = []  # FP8 pools: K, V scale per layer (empty: 1.0 everywhere, or not FP8)


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

    @model_validator(mode="after")
    def _offset_in_prompt(self) -> PrefillRequest:
        _check_output_offset(self.sampling, self.token_ids)
        return self


class KVNotice(BaseModel):
    """Prefill -> decode over NIXL, the last message of one request's transfer: no write for `req_id` follows.

    "landed": every write completed; `token` (and `logprob`) is the first sampled token. "closed": the prefill
    side gave up (`error` says why) after its posted writes completed or were cancelled.
    See common/transfer/session.py.
    """

    model_config = ConfigDict(extra="forbid")
    req_id: str = Field(min_length=1, max_length=128)
    outcome: Literal["landed", "closed"]
    token: int | None = Field(None, ge=0)
    logprob: TokenLogprob | None = None
    cached_tokens: int = Field(0, ge=0)
    checksums: list[float] | None = None  # debug mode: per-page sums on the prefill side
    error: str | None = Field(None, max_length=4000)
    # The prefill side's stage stamps (common/observability/timeline.py), wall-clock seconds by stage name.
    timeline: dict[str, float] | None = Field(None, max_length=32)

    @model_validator(mode="after")
    def _landed_has_token(self) -> KVNotice:
        if self.outcome == "landed" and self.token is None:
            raise ValueError("a landed notice carries the first token")
        return self


class PrefillProgress(BaseModel):
    """One line of the prefill worker's `/internal/prefill` NDJSON stream; the last says `done` or `error`,
    and is sent only once the request's transfer session is terminal (no write of it follows)."""

    model_config = ConfigDict(extra="ignore")
    req_id: str | None = None
    done: bool = False
    error: str | None = None
    descs: int = Field(0, ge=0)
    cached_tokens: int = Field(0, ge=0)
    heartbeat: bool = False  # sent while the prefill worker's engine is working: the decode side keeps waiting
    engine_exited: bool = False  # with ``error``: the engine that would write this request is gone (no notice comes)


class PrefillAccepted(_Message):
    req_id: str
    cached_tokens: int


class AbortRequest(_Message):
    req_id: str


MAX_CANCELS = 1024  # request ids in one CancelTransfers


class CancelTransfers(_Message):
    """Decode -> prefill: these requests' KV is no longer wanted (their decode worker gave them up). Those in
    flight are aborted (their "closed" notice follows once their writes settled); the others are refused
    should they arrive later. Answered 204."""

    dst_agent: str
    dst_instance_id: str
    req_ids: list[str] = Field(max_length=MAX_CANCELS)


class LoadSnapshot(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode", "mixed"]
    pod: str
    queued_prefill_tokens: int
    running_requests: int
    waiting_requests: int
    free_pages: int
    total_pages: int
    page_size: int
    ready: bool
    draining: bool = False
    max_running: int = 0  # batch slots (0: not reported); the router's admission counts free ones
    prefill_tokens_per_s: float = 0.0  # measured while prefill work was queued (0: not measured yet)
    # Host KV tier (0 without one): pages holding cached prefixes, its size, pages moved since start.
    host_pages_cached: int = 0
    host_pages_total: int = 0
    host_pages_saved: int = 0
    host_pages_loaded: int = 0
    # Prompt tokens one step takes at most beside the requests it decodes (stall-free batching: what fits in
    # `itl_target_s`); 0: not reported, or prefill-first scheduling, where a prompt's chunks run back to back
    # and decoding waits for all of them (the cost model then charges the whole prompt).
    prefill_chunk_tokens: int = 0
    itl_target_s: float = 0.0  # the ITL the scheduler's steps beside decoding aim at (0: none, or not measured yet)
    prefill_step_tokens_per_s: float = 0.0  # device-timed prefill speed: what a chunk adds to a step (0: unknown)
    decode_step_s: float = 0.0  # recent decode step time, smoothed (0: no decode step yet)
    live_requests: int = 0  # requests with an open stream on this worker (set by its control plane, not the engine)
    loop_turns: int = 0  # the engine loop's turns so far: an idle engine blocks, so this stays put (0: not reported)
    # The most KV tokens one request may reserve here (its share of the pool, KVFERRY_MAX_REQUEST_KV_SHARE; set by
    # the control plane); 0: not reported. The router admits by it (router/admission.py).
    max_request_tokens: int = 0
    # Output tokens a request admitted here reserves beyond its prompt (KVFERRY_KV_RESERVATION=optimistic; it grows
    # page by page after); 0: all of its max_tokens. The router's KV admission counts the same (router/admission.py).
    kv_reserve_output_tokens: int = 0
    # What predicts a new request's TTFT here (router/ttft_model.py; common/sched/snapshot.py says what each is):
    # the step-time model's seconds per unit (base_s, per_prefill_token_s, per_decode_row_s, per_context_token_s,
    # per_attention_pair_s; empty until fitted), the prompt chunk of the next step as the batch stands, the
    # decode rows and their KV context beside it, and per SLO class the prompt tokens queued ahead of a request
    # of that class arriving now.
    step_coefficients: dict[str, float] = Field(default_factory=dict, max_length=8)
    step_chunk_tokens: int = 0
    decode_rows: int = 0
    decode_context: int = 0
    queued_ahead_tokens: dict[str, int] = Field(default_factory=dict, max_length=64)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
