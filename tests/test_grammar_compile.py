"""Grammars compile off the step loop (common/sched/grammar_compiles.py), on the real model (CPU): a request whose
schema takes a while to compile waits outside the queue while the others keep producing tokens; a grammar that
does not compile fails only its request, with a clear error, and every page comes back."""

from __future__ import annotations

import json
import uuid

import pytest

from common.protocol import GrammarSpec, SamplingParams
from common.sched.request import Req, ReqState
from common.sched.scheduler import RequestRejected
from tests.engine_helpers import assert_pool_clean, fresh_engine

pytestmark = pytest.mark.timeout(300)

# 500 optional properties in one object: the most the router lets through, and one of the slowest to compile
# (~1.5 s on one CPU core, docs/reliability.md).
SLOW_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "integer"} for i in range(500)},
    "additionalProperties": False,
}


def _chat(tok, text: str) -> list[int]:
    return list(
        tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def test_a_slow_grammar_compiles_while_other_streams_go_on(smol_runner, smol_tokenizer) -> None:
    prompt = _chat(smol_tokenizer, "Count from one to one hundred in words.")
    alone = fresh_engine(smol_runner).generate([prompt], SamplingParams(max_tokens=400, ignore_eos=True))[0]

    engine = fresh_engine(smol_runner)
    sched = engine.scheduler
    streaming = Req(req_id="stream", prompt_ids=prompt, sampling=SamplingParams(max_tokens=400, ignore_eos=True))
    sched.add(streaming)
    while len(streaming.output_ids) < 4:
        sched.step()

    spec = GrammarSpec(kind="json_schema", value=json.dumps(SLOW_SCHEMA))
    structured = Req(
        req_id="json",
        prompt_ids=_chat(smol_tokenizer, "Give me a JSON object with a few integer fields."),
        sampling=SamplingParams(max_tokens=48, grammar=spec),
    )
    sched.add(structured)  # returns at once: the schema compiles on a worker thread
    assert structured.state is ReqState.COMPILING
    assert structured not in sched.waiting and sched.has_request("json")
    at_add = len(streaming.output_ids)
    while not structured.output_ids and not structured.finished:
        sched.step()
    during_compile = len(streaming.output_ids) - at_add
    assert during_compile > 0, "the stream produced nothing while the schema compiled"
    while not (streaming.finished and structured.finished):
        sched.step()

    assert streaming.output_ids == alone.output_ids  # the stream's text is what it is alone
    assert structured.error is None and structured.finish_reason in ("stop", "length"), structured.error
    if structured.finish_reason == "stop":
        eos = smol_runner.model_config.eos_token_ids
        text = smol_tokenizer.decode([t for t in structured.output_ids if t not in eos])
        value = json.loads(text)
        assert isinstance(value, dict) and set(value) <= set(SLOW_SCHEMA["properties"])
        assert all(isinstance(v, int) for v in value.values())
    # The compiled grammar is cached: the next request with the schema is queued at once.
    again = Req(req_id="again", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2, grammar=spec))
    sched.add(again)
    assert again.state is ReqState.WAITING
    sched.abort("again")
    print(f"\ntokens streamed while the schema compiled: {during_compile}")
    assert_pool_clean(engine)


def test_a_grammar_that_does_not_parse_is_refused_where_it_arrives(smol_runner, smol_tokenizer) -> None:
    """A grammar that does not parse is refused when the request is added (a 400 at the worker's edge), before any
    compile; the engine keeps serving and nothing is held."""
    engine = fresh_engine(smol_runner)
    prompt = _chat(smol_tokenizer, "Say hello.")
    for spec in (GrammarSpec(kind="regex", value="(unclosed[a-"), GrammarSpec(kind="ebnf", value="root ::= (")):
        with pytest.raises(RequestRejected, match=f"invalid {spec.kind}"):
            engine.scheduler.add(Req("bad", list(prompt), SamplingParams(max_tokens=8, grammar=spec)))
    (served,) = engine.generate([prompt], [SamplingParams(max_tokens=8)])
    assert served.finish_reason in ("stop", "length") and served.output_ids
    assert not engine.scheduler.has_work()
    assert_pool_clean(engine)


def test_a_grammar_past_its_compile_deadline_fails_only_its_request(smol_runner, smol_tokenizer) -> None:
    """The slow schema under a deadline far shorter than its compile: that request ends with an error and no
    tokens, the other one is served, and every page comes back."""
    engine = fresh_engine(smol_runner)
    engine.scheduler.compiles.timeout_s = 1e-3
    prompt = _chat(smol_tokenizer, "Say hello.")
    unique = {**SLOW_SCHEMA, "properties": {**SLOW_SCHEMA["properties"], f"x{uuid.uuid4().hex}": {"type": "string"}}}
    slow = SamplingParams(max_tokens=8, grammar=GrammarSpec(kind="json_schema", value=json.dumps(unique)))
    failed, served = engine.generate([prompt, prompt], [slow, SamplingParams(max_tokens=8)])
    assert failed.finish_reason == "error" and failed.output_ids == []
    assert served.finish_reason in ("stop", "length") and served.output_ids
    assert engine.scheduler.take_compile_failures() == [] and not engine.scheduler.has_work()
    assert_pool_clean(engine)
