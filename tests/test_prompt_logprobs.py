"""Prompt logprobs (vLLM's `prompt_logprobs`, completions' echo with logprobs) on CPU against transformers' own
log-softmax of the same model: in the engine (one chunk and many, a cached prefix), then through the router on a
real cluster (a short prompt prefilled on the decode worker, a long one on the prefill worker and sent on), in
the shapes lm-eval-harness and the `openai` SDK read, with every KV page back after a batch and a disconnect."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from common.devcluster.cluster import LocalCluster
from common.protocol import PROMPT_LOGPROBS_LINE_BYTES, PromptLogprobs, SamplingParams
from tests.engine_helpers import fresh_engine
from tests.helpers import assert_openai_error, running_cluster, wait_pages_back, wait_until
from tests.workers import generate_body

MODEL = "smollm2-135m-instruct"
TOL = 2e-3  # absolute, on logprobs: both sides compute in float32 (summation orders differ)
TOP = 5
PAGE = 16
CHUNK = 32  # prefill chunk tokens in the cluster: the long prompt takes several
DISAGG_MIN = 48  # prompts this long go through the prefill worker
ENV = {
    "KVFERRY_NUM_PAGES": "256",
    "KVFERRY_PAGE_SIZE": str(PAGE),
    "KVFERRY_MAX_PREFILL_TOKENS": str(CHUNK),
    "KVFERRY_MAX_RUNNING": "8",
    "KVFERRY_ROUTER_DISAGG_MIN_PROMPT_TOKENS": str(DISAGG_MIN),
    "KVFERRY_ROUTER_LOCAL_PREFIX_FRACTION": "2",  # a long prompt is never prefilled on the decode worker
}
TEXT = (
    "The river wound through the valley, past the mill and the old stone bridge, where the children of the "
    "village gathered every evening to watch the boats come home. "
)


@torch.inference_mode()
def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax over the prompt: row p is the distribution of token p+1."""
    return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_against(ref: torch.Tensor, ids: list[int], got: PromptLogprobs, top: int) -> None:
    """Every position's logprob, rank and top-`top` agree with the reference."""
    n = len(ids) - 1
    assert len(got.logprobs) == len(got.ranks) == n
    want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (torch.tensor(got.logprobs) - want).abs().max().item() < TOL
    for p in range(n):
        row, lp = ref[p], want[p].item()
        # The rank is 1 + the tokens likelier than the prompt's own; near-ties may fall either way.
        assert int((row > lp + TOL).sum()) + 1 <= got.ranks[p] <= int((row > lp - TOL).sum()) + 1
    if not top:
        assert got.top_ids == [] and got.top_logprobs == []
        return
    assert len(got.top_ids) == n and all(len(t) == top for t in got.top_ids)
    kth = ref[:-1].topk(top, dim=-1).values[:, -1]
    for p in range(n):
        values = got.top_logprobs[p]
        assert values == sorted(values, reverse=True)
        assert all(abs(v - ref[p, i].item()) < TOL for i, v in zip(got.top_ids[p], values))
        assert values[-1] > kth[p].item() - TOL  # none likelier was left out
        rank = got.ranks[p]
        if rank <= top:  # the prompt's own token is among the top-N, at its rank
            assert values[rank - 1] == got.logprobs[p]
            assert got.top_ids[p][rank - 1] == ids[p + 1] or values.count(values[rank - 1]) > 1


def as_columns(entries: list, top: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` list (null first, then token id -> {logprob, rank, decoded_token}) as columns;
    each position's first entry is the prompt's own token, then the top-N in order."""
    assert entries[0] is None
    out = PromptLogprobs()
    for e in entries[1:]:
        items = list(e.items())
        own = items[0][1]
        out.logprobs.append(own["logprob"])
        out.ranks.append(own["rank"])
        tops = sorted(((int(k), v) for k, v in items), key=lambda kv: kv[1]["rank"])
        tops = [(k, v) for k, v in tops if v["rank"] <= top][:top]
        out.top_ids.append([k for k, _ in tops])
        out.top_logprobs.append([v["logprob"] for _, v in tops])
    return out


def test_pieces_stay_under_their_bound_and_join_back() -> None:
    import msgspec

    n, top = 1000, 20
    whole = PromptLogprobs(
        [-1.0 / (i + 3) - 12.345678901234567 for i in range(n)],
        [49151 - i for i in range(n)],
        [[49151 - j for j in range(top)] for _ in range(n)],
        [[-9.87654321098765e-05 - j for j in range(top)] for _ in range(n)],
    )
    budget = 64 * 1024
    pieces = whole.pieces(budget)
    assert len(pieces) > 1 and all(len(msgspec.json.encode(p)) <= budget for p in pieces)
    joined = PromptLogprobs()
    for p in pieces:
        joined.extend(p)
    assert joined == whole
    assert whole.pieces(10**9) == [whole]


def test_echo_without_scores_keeps_a_null_per_prompt_token(smol_path) -> None:
    """A first token line without prompt scores (a worker that did not compute them) still gives every legacy
    list one entry per prompt token: nulls, not a shorter list beside ``tokens``."""
    from router.surface.responses import echo_logprobs
    from router.surface.tokenizer import RouterTokenizer

    tok = RouterTokenizer.from_dir(smol_path)
    ids = tok.encode(TEXT)
    head, offset = echo_logprobs(ids, None, TOP, tok)
    assert head["tokens"] and len(head["tokens"]) == len(ids)
    for key in ("token_logprobs", "top_logprobs", "text_offset"):
        assert len(head[key]) == len(ids), key
    assert head["token_logprobs"] == [None] * len(ids) and head["top_logprobs"] == [None] * len(ids)
    assert offset == len("".join(head["tokens"]))


# ---- the engine ------------------------------------------------------------------------------------------
def test_engine_scores_every_position_in_one_chunk_or_many_and_past_a_cached_prefix(
    smol_runner, hf_smol, smol_tokenizer
) -> None:
    ids = smol_tokenizer.encode(TEXT * 3)
    assert len(ids) > 3 * CHUNK
    ref = reference(hf_smol, ids)
    one = fresh_engine(smol_runner, max_prefill_tokens=512)
    [whole] = one.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=TOP))
    check_against(ref, ids, whole.prompt_logprobs, TOP)
    chunked = fresh_engine(smol_runner, max_prefill_tokens=CHUNK)
    # Beside a request that asks for nothing (its step computes only its last position).
    scored, plain = chunked.generate(
        [ids, ids[:40]], [SamplingParams(max_tokens=2, prompt_logprobs=TOP), SamplingParams(max_tokens=2)]
    )
    assert plain.prompt_logprobs is None
    check_against(ref, ids, scored.prompt_logprobs, TOP)
    got, want = torch.tensor(scored.prompt_logprobs.logprobs), torch.tensor(whole.prompt_logprobs.logprobs)
    assert (got - want).abs().max().item() < 1e-4  # chunking changes no number
    assert scored.output_ids[0] == whole.output_ids[0]
    # The prompt is cached now: a plain request takes the hit, a scored one computes every position.
    [hit] = chunked.generate([ids], SamplingParams(max_tokens=1))
    assert hit.cached_tokens > 0
    [again] = chunked.generate([ids + ids[:9]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert again.cached_tokens == 0
    check_against(reference(hf_smol, ids + ids[:9]), ids + ids[:9], again.prompt_logprobs, 0)
    assert not chunked.scheduler.table_violations()


# ---- through the router ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(prefill=1, decode=1, env=ENV) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="none", max_retries=0, timeout=180)


def disaggregated(cluster: LocalCluster) -> float:
    text = httpx.get(f"{cluster.router_url}/metrics", timeout=10).text
    m = re.search(r'^kvferry_router_routing_decisions_total\{decision="disaggregated"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def router_sees_idle(cluster: LocalCluster) -> bool:
    workers = httpx.get(f"{cluster.router_url}/router/workers", timeout=5).json()["workers"]
    return all(w["free_pages"] == w["total_pages"] and not w["inflight_requests"] for w in workers)


def complete(cluster: LocalCluster, **body: object) -> dict:
    r = httpx.post(f"{cluster.router_url}/v1/completions", json={"temperature": 0, **body}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("path", ["local", "disaggregated"])
def test_prompt_logprobs_through_the_router_match_transformers(
    cluster: LocalCluster, hf_smol, smol_tokenizer, path: str
) -> None:
    ids = smol_tokenizer.encode(TEXT * (3 if path == "disaggregated" else 1))[: 4 * CHUNK + 5]
    assert (len(ids) >= DISAGG_MIN) == (path == "disaggregated")
    before = disaggregated(cluster)
    body = complete(cluster, prompt=ids, max_tokens=2, prompt_logprobs=TOP, n=2)
    assert disaggregated(cluster) - before == (2 if path == "disaggregated" else 0)
    ref = reference(hf_smol, ids)
    for choice in body["choices"]:  # computed once per prompt, shown on every choice
        check_against(ref, ids, as_columns(choice["prompt_logprobs"], TOP), TOP)
        entry = choice["prompt_logprobs"][1][str(ids[1])]
        assert entry["decoded_token"] == smol_tokenizer.decode([ids[1]])
    wait_pages_back(*cluster.prefill_urls, *cluster.decode_urls)


def test_a_long_prompts_logprobs_cross_in_pieces(cluster: LocalCluster, hf_smol, smol_tokenizer) -> None:
    """Past one token-stream line's share (PROMPT_LOGPROBS_LINE_BYTES) the decode worker sends them in pieces
    on lines ahead of the first token; the router joins them."""
    ids = smol_tokenizer.encode(TEXT * 45)[:1400]
    routed = complete(cluster, prompt=ids, max_tokens=1, prompt_logprobs=TOP)
    check_against(reference(hf_smol, ids), ids, as_columns(routed["choices"][0]["prompt_logprobs"], TOP), TOP)
    # The decode worker's own stream (prefilled there: no peer named).
    body = generate_body(ids, max_tokens=1)
    body["sampling"]["prompt_logprobs"] = TOP
    with httpx.stream("POST", f"{cluster.decode_urls[0]}/internal/generate", json=body, timeout=180) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line) for line in lines]
    ahead = [i for i, ev in enumerate(events) if "prompt_logprobs" in ev and not ev.get("token_ids")]
    assert ahead == list(range(len(ahead))) and ahead, "pieces first, then the first token"
    assert all(len(lines[i]) <= PROMPT_LOGPROBS_LINE_BYTES for i in ahead)
    assert sum(len(ev["prompt_logprobs"]["logprobs"]) for ev in events if "prompt_logprobs" in ev) == len(ids) - 1
    wait_pages_back(*cluster.decode_urls)
    # The router admits by its own polls of the worker: the next test's requests wait until they show it idle.
    wait_until(lambda: router_sees_idle(cluster), 30, "the router's view of an idle decode worker")


def test_a_cached_prefix_still_gets_every_position(cluster: LocalCluster, hf_smol, smol_tokenizer) -> None:
    ids = smol_tokenizer.encode("A cached prefix: " + TEXT * 3)[: 3 * CHUNK]
    complete(cluster, prompt=ids, max_tokens=1)
    again = complete(cluster, prompt=ids, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prefix is cached
    longer = ids + smol_tokenizer.encode(" and more")
    body = complete(cluster, prompt=longer, max_tokens=1, prompt_logprobs=1)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    check_against(reference(hf_smol, longer), longer, as_columns(body["choices"][0]["prompt_logprobs"], 1), 1)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request_shape(cluster: LocalCluster, hf_smol, smol_tokenizer, max_tokens: int) -> None:
    """lm-eval's `local-completions` loglikelihood: token ids in, echo, logprobs 1, greedy; it sums
    token_logprobs over the continuation and checks each against max(top_logprobs)."""
    context = smol_tokenizer.encode("Question: What is the capital of France?\nAnswer:")
    continuation = smol_tokenizer.encode(" Paris")
    ids = context + continuation
    body = complete(cluster, prompt=[ids], max_tokens=max_tokens, logprobs=1, echo=True, seed=1234)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"].startswith(smol_tokenizer.decode(ids)) and "prompt_logprobs" not in choice
    if max_tokens == 0:
        assert choice["text"] == smol_tokenizer.decode(ids) and body["usage"]["completion_tokens"] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    ref = reference(hf_smol, ids)
    want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(lp["token_logprobs"][1 : len(ids)])
    assert (got - want).abs().max().item() < TOL
    ctx = len(context)
    for p in range(ctx, len(ids)):
        greedy = int(ref[p - 1].argmax()) == ids[p]
        top = lp["top_logprobs"][p]
        assert 1 <= len(top) <= 2 and lp["tokens"][p] in top
        assert (lp["token_logprobs"][p] == max(top.values())) == greedy


def test_the_openai_sdk_parses_echo_with_logprobs(client: openai.OpenAI, smol_tokenizer) -> None:
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0)
    choice = out.choices[0]
    n = len(smol_tokenizer.encode(prompt))
    assert choice.text.startswith(prompt) and choice.logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == n + 3
    assert "".join(choice.logprobs.tokens) == choice.text
    # Streamed: the prompt's part comes in the first chunk, the output's after it, in order.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text.startswith(prompt) and first.logprobs.token_logprobs[0] is None
    tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
    assert tokens == choice.logprobs.tokens
    offsets = [o for c in chunks if c.choices for o in c.choices[0].logprobs.text_offset]
    assert offsets == choice.logprobs.text_offset
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 2},
    )
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(1 <= len(e) <= 3 for e in entries[1:])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, None),
        ({"prompt": "Hi", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": "Hi", "max_tokens": 0}, None),
    ],
    ids=["too-many", "negative", "streamed", "echo-logprobs-too-many", "max-tokens-0-without-echo"],
)
def test_out_of_range_requests_are_openai_400s(cluster: LocalCluster, body: dict, param: str | None) -> None:
    r = httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = assert_openai_error(r.json())
    if param is not None:
        assert err["param"] == param, err


def test_pages_back_after_a_batch_and_a_disconnect(cluster: LocalCluster, smol_tokenizer) -> None:
    ids = smol_tokenizer.encode(TEXT * 3)[: 3 * CHUNK]
    prompts = [ids, ids[:20], ids[5:60], ids[:33]]  # both paths, in one request
    body = complete(cluster, prompt=prompts, max_tokens=4, logprobs=2, echo=True, n=2, prompt_logprobs=3)
    assert len(body["choices"]) == 8
    for c in body["choices"]:
        p = prompts[c["index"] // 2]
        assert len(c["prompt_logprobs"]) == len(p) and len(c["logprobs"]["tokens"]) == len(p) + 4
    wait_pages_back(*cluster.prefill_urls, *cluster.decode_urls)
    # A stream given up after its first chunk (the prompt's part): its pages come back on both workers.
    for prompt in (ids, ids[:20]):
        req = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "echo": True, "logprobs": 1, "stream": True}
        with httpx.stream("POST", f"{cluster.router_url}/v1/completions", json=req, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
        wait_pages_back(*cluster.prefill_urls, *cluster.decode_urls, timeout=30)


def test_a_mixed_worker_serves_them_too(hf_smol, smol_tokenizer) -> None:
    """One mixed worker (prefill and decode over one engine): the prompt's logprobs come with its first line."""
    ids = smol_tokenizer.encode(TEXT * 2)
    with running_cluster(prefill=0, decode=0, mixed=1, env=ENV) as c:
        body = complete(c, prompt=ids, max_tokens=1, prompt_logprobs=2, echo=True, logprobs=1)
        choice = body["choices"][0]
        check_against(reference(hf_smol, ids), ids, as_columns(choice["prompt_logprobs"], 2), 2)
        assert choice["logprobs"]["token_logprobs"][1 : len(ids)] == [
            e[str(t)]["logprob"] for e, t in zip(choice["prompt_logprobs"][1:], ids[1:])
        ]
        wait_pages_back(*c.mixed_urls)
