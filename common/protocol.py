"""Messages between router and workers, between workers over HTTP and NIXL, and the token stream: msgspec Structs,
decoded (validated) once where they enter a process and typed from there (docs/architecture.md, "The wire")."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

PROTOCOL_VERSION = 1
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 2048  # entries in one request's logit_bias map
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CANCELS = 1024  # request ids in one CancelTransfers
FinishReason = Literal["stop", "length", "abort", "error"]  # why a worker ended a request

ReqId = Annotated[str, Meta(min_length=1, max_length=128)]
# A prompt's token ids held for a request's life (router and worker HTTP processes): a tuple, because the cyclic
# collector stops walking a tuple of ints after its first young collection, where a list of 2k ids is 2k items
# every full collection walks (300 such lists in flight made 38 ms gen-2 pauses: every stream's token gap).
TokenIds = tuple[int, ...]
Prompt = Annotated[TokenIds, Meta(min_length=1)]
T = TypeVar("T")


class Schema(Struct, forbid_unknown_fields=True):
    """A wire struct: unknown fields refused."""


class Versioned(Schema, kw_only=True):
    """A top-level HTTP body between kvferry processes."""

    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if self.protocol_version != PROTOCOL_VERSION:
            raise ValueError(
                f"unsupported protocol_version {self.protocol_version}; this worker speaks {PROTOCOL_VERSION}"
            )


class _VersionOnly(Struct):
    protocol_version: int = PROTOCOL_VERSION


def foreign_version(data: bytes) -> str | None:
    """Why a body is refused when the reason is a protocol version this process does not speak (said first:
    its other fields may be a newer version's)."""
    try:
        version = msgspec.json.decode(data, type=_VersionOnly).protocol_version
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    if version == PROTOCOL_VERSION:
        return None
    return f"unsupported protocol_version {version}; this worker speaks {PROTOCOL_VERSION}"


class GrammarSpec(Schema, frozen=True):
    """A constraint on the whole output (JSON schema, any JSON object, regex or EBNF). The spec travels, never
    compiled state: each worker compiles it and replays the tokens sampled before it took over."""

    kind: Literal["json_schema", "json_object", "regex", "ebnf"]
    value: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] = ""


class SamplingParams(Schema):
    """What decides the next token; defaults are greedy with no limits. Ranges are checked on decode only."""

    max_tokens: Annotated[int, Meta(ge=1)] = 16
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1  # -1 or 0: off
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None  # the sampler hashes it as an int64
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    stop_token_ids: Annotated[list[int], Meta(max_length=1024)] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    # The prompt's logprobs with this many alternatives per position (None: not computed). A request asking for
    # them computes its whole prompt: the prefix cache's pages were never scored.
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Added to the logits first (token id -> bias); -100 bans a token, +100 all but forces it.
    logit_bias: Annotated[dict[int, float], Meta(max_length=MAX_LOGIT_BIAS)] = {}
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0  # over prompt and output tokens; 1 = off
    min_tokens: Annotated[int, Meta(ge=0)] = 0  # EOS and stop_token_ids are masked until this many tokens are out
    grammar: GrammarSpec | None = None
    # A continued request's last `output_offset` prompt tokens are its earlier output: sampled and penalised as
    # output positions, so a seeded draw is the same on every worker.
    output_offset: Annotated[int, Meta(ge=0)] = 0
    # The SLO class (common/slo.py; "": the default): its queue deadline and ITL target.
    slo_class: Annotated[str, Meta(max_length=64)] = ""
    # Of the class's ITL target, the part the path after the engine takes (the router's measured relay lateness,
    # common/loop_lag.py): the request's steps aim that much under the target (at most a share of it).
    itl_allowance_ms: Annotated[float, Meta(ge=0.0, le=10_000.0)] = 0.0

    def __post_init__(self) -> None:
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise ValueError(f"logit_bias token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias value {bias} for token {token} is outside [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class TokenLogprob(Schema, frozen=True):
    """Log-probability of the chosen token, and the top-N alternatives (token id, logprob)."""

    logprob: float
    top: list[tuple[int, float]] = []


# Upper bounds of one position's JSON in `PromptLogprobs` (a float64 repr is at most 24 characters, an id 7):
# its logprob and rank, and each alternative's id and logprob.
_POSITION_JSON_BYTES = 40
_ALTERNATIVE_JSON_BYTES = 34
PROMPT_LOGPROBS_LINE_BYTES = 256 * 1024  # prompt logprobs per token-stream line, at most


class PromptLogprobs(Schema):
    """The prompt's logprobs, columns over positions 1.. of the prompt (the first token has none): each token's
    logprob given the tokens before it, its rank in that distribution (1: the likeliest), and the top-N
    alternatives there (ids and logprobs, likeliest first; both columns empty for N = 0). Columns, not one struct per
    token: built from tensors and encoded without a Python object per position."""

    logprobs: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []

    def pieces(self, max_bytes: int) -> list[PromptLogprobs]:
        """Consecutive runs of positions, each about `max_bytes` of JSON at most (one when it fits): a token
        stream's lines are bounded (router/wire.py), a long prompt's logprobs are not."""
        top = len(self.top_ids[0]) if self.top_ids else 0
        step = max(1, max_bytes // (_POSITION_JSON_BYTES + top * _ALTERNATIVE_JSON_BYTES))
        n = len(self.logprobs)
        if n <= step:
            return [self]
        return [
            PromptLogprobs(
                self.logprobs[i : i + step],
                self.ranks[i : i + step],
                self.top_ids[i : i + step],
                self.top_logprobs[i : i + step],
            )
            for i in range(0, n, step)
        ]

    def extend(self, more: PromptLogprobs) -> None:
        """Appends the positions that follow (a later piece)."""
        self.logprobs += more.logprobs
        self.ranks += more.ranks
        self.top_ids += more.top_ids
        self.top_logprobs += more.top_logprobs


def _check_output_offset(sampling: SamplingParams, token_ids: TokenIds) -> None:
    if sampling.output_offset >= len(token_ids):
        raise ValueError("sampling.output_offset must be shorter than the prompt")


class GenerateRequest(Versioned):
    """Router -> decode worker. `prefill_url` None: the decode worker prefills locally."""

    req_id: ReqId
    token_ids: Prompt
    sampling: SamplingParams
    prefill_url: str | None = None
    # Deadline for the remote prefill and its KV transfer (None: the decode worker's default), the writes' too.
    kv_timeout_s: Annotated[float, Meta(gt=0, le=3600)] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_output_offset(self.sampling, self.token_ids)


class TokenLine(Struct, kw_only=True, omit_defaults=True):
    """One line of the decode worker's NDJSON generate stream: new tokens; the first line carries the prompt's
    counts and stage stamps, the last a finish reason. Unknown fields are ignored."""

    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    # When the request asked for them: on the first line, or, for a long prompt, in pieces on lines with no token
    # before it (PromptLogprobs.pieces), which the reader joins into the first line's.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    timeline: dict[str, float] | None = None  # the workers' stage stamps, by stage name
    finish_reason: FinishReason | None = None
    error: str | None = None
    kv_verified: bool | None = None  # debug mode: page checksums of the transferred KV matched
    # With "error": only the worker was lost, not the request (router/upstream/migration.py continues it).
    retryable: bool = False
    # With "error" before any token: the prefill worker was too busy; the router tries elsewhere, else 429.
    overloaded: bool = False
    # With "error": the request cannot be served as asked (its grammar admits no token of this model's
    # vocabulary): the router answers 400 and does not retry it elsewhere.
    invalid_request: bool = False


class KVLayoutInfo(Schema, frozen=True):
    """What must match between a prefill and a decode worker before KV moves between them."""

    model_id: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout_version: int
    tp_size: int = 1
    kv_scales: list[float] = []  # FP8 pools: K, V scale per layer (empty: 1.0 everywhere, or not FP8)
    kv_parts: int = 2  # entries per token and layer: K and V, or 1 (MLA's latent)


class HandshakeRequest(Versioned):
    """Decode -> prefill: the decode agent's NIXL metadata and KV layout."""

    agent_name: str
    instance_id: str
    agent_metadata_b64: str
    pool_info_b64: str
    layout: KVLayoutInfo


class HandshakeResponse(Versioned):
    agent_name: str
    instance_id: str
    layout: KVLayoutInfo


class PrefillRequest(Versioned):
    """Decode -> prefill: prefill `token_ids` and WRITE their KV into `dst_pages` of agent `dst_agent`."""

    req_id: ReqId
    token_ids: Prompt
    sampling: SamplingParams
    dst_agent: str
    dst_instance_id: str
    dst_pages: list[int]
    deadline_s: Annotated[float, Meta(gt=0)] = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_output_offset(self.sampling, self.token_ids)


class KVNotice(Schema, frozen=True, omit_defaults=True):
    """Prefill -> decode over NIXL, the last message of a transfer (common/transfer/session.py): "landed" (every
    write completed; `token` is the first sampled token) or "closed" (the prefill side gave up, `error` says why)."""

    req_id: ReqId
    outcome: Literal["landed", "closed"]
    token: Annotated[int, Meta(ge=0)] | None = None
    logprob: TokenLogprob | None = None
    prompt_logprobs: PromptLogprobs | None = None
    cached_tokens: Annotated[int, Meta(ge=0)] = 0
    checksums: list[float] | None = None  # debug mode: per-page sums on the prefill side
    error: Annotated[str, Meta(max_length=4000)] | None = None
    # The prefill side's stage stamps (common/observability/timeline.py), wall-clock seconds by stage.
    timeline: Annotated[dict[str, float], Meta(max_length=32)] | None = None

    def __post_init__(self) -> None:
        if self.outcome == "landed" and self.token is None:
            raise ValueError("a landed notice carries the first token")


class PrefillProgress(Struct, kw_only=True, omit_defaults=True):
    """One line of `/internal/prefill`'s NDJSON stream; the last (`done` or `error`) comes once the transfer is
    terminal. Unknown fields are ignored."""

    req_id: str | None = None
    done: bool = False
    error: str | None = None
    descs: Annotated[int, Meta(ge=0)] = 0
    cached_tokens: Annotated[int, Meta(ge=0)] = 0
    heartbeat: bool = False  # sent while the prefill worker's engine is working: the decode side keeps waiting
    engine_exited: bool = False  # with ``error``: the engine that would write this request is gone (no notice comes)


class AbortRequest(Versioned):
    req_id: str


class CancelTransfers(Versioned):
    """Decode -> prefill: these requests' KV is no longer wanted; in-flight ones are aborted, later ones refused."""

    dst_agent: str
    dst_instance_id: str
    req_ids: Annotated[list[str], Meta(max_length=MAX_CANCELS)]


class LoadSnapshot(Schema):
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
    # Page-locked so far: the tier takes pages once every one is (locking runs in the engine's idle turns).
    host_pages_locked: int = 0
    host_pages_saved: int = 0
    host_pages_loaded: int = 0
    # Prompt tokens one step takes beside decoding (0: not reported, or prefill-first scheduling).
    prefill_chunk_tokens: int = 0
    itl_target_s: float = 0.0  # the ITL the scheduler's steps beside decoding aim at (0: none, or not measured yet)
    prefill_step_tokens_per_s: float = 0.0  # device-timed prefill speed: what a chunk adds to a step (0: unknown)
    decode_step_s: float = 0.0  # recent decode step time, smoothed (0: no decode step yet)
    live_requests: int = 0  # requests with an open stream on this worker (set by its control plane, not the engine)
    # Prompt tokens accepted to prefill here since start (set by its control plane): a router process reads the
    # other processes' placements from it (router/decision/peers.py).
    prompt_tokens_accepted: int = 0
    # Requests accepted to decode here since start (set by its control plane): the decode pick's count of what other
    # router processes placed here since the snapshot (router/decision/pool.py `unseen_decodes`).
    decodes_accepted: int = 0
    loop_turns: int = 0  # the engine loop's turns so far: an idle engine blocks, so this stays put (0: not reported)
    idle_trimmed: bool = False  # idle since its last work (or start), the engine handed its free heap memory back
    # The most KV tokens one request may reserve here (KVFERRY_MAX_REQUEST_KV_SHARE); 0: not reported.
    max_request_tokens: int = 0
    # Output tokens a request reserves beyond its prompt (KVFERRY_KV_RESERVATION=optimistic); 0: all of max_tokens.
    kv_reserve_output_tokens: int = 0
    # Preemptions since start: all, those whose KV was parked in the host tier (KVFERRY_PREEMPT_MODE), and
    # the tokens prefilled again that had KV before one.
    preemptions: int = 0
    preemptions_parked: int = 0
    recomputed_tokens: int = 0
    # Steps beside decoding past the ITL target since start: caused by their chunk (each trims the budget), and
    # gaps that were mostly host time (common/sched/itl_trim.py).
    step_overruns: int = 0
    step_stalls: int = 0
    # What predicts a new request's TTFT here (router/decision/ttft_model.py; common/sched/snapshot.py says what
    # each is): the step-time model's coefficients, the next chunk, decode rows and queued tokens per class.
    step_coefficients: Annotated[dict[str, float], Meta(max_length=8)] = {}
    step_chunk_tokens: int = 0
    decode_rows: int = 0
    decode_context: int = 0
    queued_ahead_tokens: Annotated[dict[str, int], Meta(max_length=64)] = {}
    # The engine process's garbage collections since it started (common/gc_pauses.py): count, seconds, longest.
    gc_collections: int = 0
    gc_pause_s: float = 0.0
    gc_pause_max_s: float = 0.0
    # The device allocator's retries since it started (common/engine/allocator_stats.py): each a host stall.
    alloc_retries: int = 0


# ---- encoding and decoding -----------------------------------------------------------------------------
DecodeError = msgspec.DecodeError  # a body that is not JSON, or not the message (ValidationError is one)
_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | str, type_: type[T]) -> T:
    """JSON bytes as a ``type_``, validated; raises ``DecodeError`` saying what is wrong and where."""
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        return dec.decode(data)  # type: ignore[no-any-return]
    except UnicodeDecodeError as e:  # a string that is not UTF-8: as malformed as any other bad byte
        raise DecodeError(f"JSON is malformed: {e}") from None


def convert(obj: Any, type_: type[T]) -> T:
    """Plain values (parsed JSON, a dict of fields) as a ``type_``, validated like ``decode``."""
    return msgspec.convert(obj, type_)


def to_builtins(msg: Any) -> Any:
    return msgspec.to_builtins(msg)


replace = msgspec.structs.replace  # a copy with some fields changed (not re-validated: the caller's values)
