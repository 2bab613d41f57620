"""The seam of a migrated request, on the engine: a request continued from prompt + its first k output tokens
with ``output_offset=k`` produces exactly the tokens an uninterrupted run produces after position k: greedy,
seeded sampling (the sampler's noise is keyed by seed and output position) and penalties (the earlier output
counts). The same scheduler runs on every worker, so this is what router/upstream/migration.py relies on; the kill -9
versions with real processes are in tests/test_reliability.py."""

from __future__ import annotations

import json

import pytest

from common.protocol import GenerateRequest, GrammarSpec, SamplingParams
from tests.engine_helpers import fresh_engine

PROMPT = "Once upon a time, in a small village by the sea,"
SEAM = 7
TOKENS = 20


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 1234},
        {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 77},
        {"temperature": 0.8, "seed": 5, "frequency_penalty": 1.5, "presence_penalty": 0.8},
        {"temperature": 0.0, "frequency_penalty": 2.0},
        {"temperature": 0.7, "seed": 9, "repetition_penalty": 1.4, "presence_penalty": 0.3},
    ],
    ids=["greedy", "seeded", "seeded-top-p-top-k", "seeded-penalties", "greedy-penalty", "seeded-repetition"],
)
def test_continuation_from_the_seam_equals_an_uninterrupted_run(smol_runner, smol_tokenizer, params) -> None:
    engine = fresh_engine(smol_runner)
    prompt = smol_tokenizer.encode(PROMPT)
    base = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=True, **params)
    whole = engine.generate([prompt], base)[0].output_ids
    assert len(whole) == TOKENS
    continued = SamplingParams(max_tokens=TOKENS - SEAM, ignore_eos=True, logprobs=True, output_offset=SEAM, **params)
    rest = fresh_engine(smol_runner).generate([prompt + whole[:SEAM]], continued)[0].output_ids
    assert whole[:SEAM] + rest == whole


def test_sampled_continuation_without_the_offset_differs(smol_runner, smol_tokenizer) -> None:
    """The offset is what keeps a seeded request on its path (so the test above can fail)."""
    prompt = smol_tokenizer.encode(PROMPT)
    params = {"temperature": 1.0, "seed": 1234, "ignore_eos": True}
    whole = fresh_engine(smol_runner).generate([prompt], SamplingParams(max_tokens=TOKENS, **params))[0].output_ids
    rest = (
        fresh_engine(smol_runner)
        .generate([prompt + whole[:SEAM]], SamplingParams(max_tokens=TOKENS - SEAM, **params))[0]
        .output_ids
    )
    assert whole[:SEAM] + rest != whole


def test_output_offset_must_leave_a_prompt() -> None:
    with pytest.raises(ValueError, match="output_offset"):
        GenerateRequest(req_id="r", token_ids=[1, 2], sampling=SamplingParams(output_offset=2))
    GenerateRequest(req_id="r", token_ids=[1, 2, 3], sampling=SamplingParams(output_offset=2))


@pytest.mark.parametrize("seam", [1, SEAM])
def test_grammar_continuation_from_the_seam_equals_an_uninterrupted_run(smol_runner, smol_tokenizer, seam) -> None:
    """A grammar request continued after `seam` tokens: its matcher replays the earlier output before its first
    mask, also when it is one token (the fill then sees a matcher with nothing accepted and no output yet)."""
    spec = GrammarSpec(
        kind="json_schema", value=json.dumps({"type": "object", "properties": {"a": {"type": "string"}}})
    )
    prompt = smol_tokenizer.encode("Reply with a JSON object: ")
    base = SamplingParams(max_tokens=TOKENS, ignore_eos=True, grammar=spec)
    whole = fresh_engine(smol_runner).generate([prompt], base)[0].output_ids
    continued = SamplingParams(max_tokens=TOKENS - seam, ignore_eos=True, grammar=spec, output_offset=seam)
    rest = fresh_engine(smol_runner).generate([prompt + whole[:seam]], continued)[0]
    assert rest.finish_reason != "error"
    assert whole[:seam] + rest.output_ids == whole[: seam + len(rest.output_ids)]
