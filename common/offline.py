"""The offline engine: a model runner and a scheduler in one process, driven to completion.

It composes the engine (common/engine) and the scheduler (common/sched), so it sits above both, beside the
serving layer: `kvferry generate`, tests and benchmarks use it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from common.engine.runner import ModelRunner
from common.protocol import PromptLogprobs, SamplingParams, TokenLogprob
from common.sched.request import Req
from common.sched.scheduler import Scheduler
from common.settings import RunnerConfig, SchedulerConfig


@dataclass
class GenerateResult:
    req_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # why it ended with finish_reason "error": a grammar that did not compile, a step that failed
    error: str | None = None


class Engine:
    def __init__(
        self,
        runner_cfg: RunnerConfig | None = None,
        sched_cfg: SchedulerConfig | None = None,
        runner: ModelRunner | None = None,
        load_tokenizer: bool = True,
    ) -> None:
        self.runner = runner or ModelRunner(runner_cfg or RunnerConfig())
        self.scheduler = Scheduler(self.runner, sched_cfg or SchedulerConfig())
        self.tokenizer: Any = None
        if load_tokenizer and self.runner.model_path is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.runner.model_path)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeError("this engine has no tokenizer (dummy weights): pass token ids")
        if chat:
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return list(self.tokenizer.encode(prompt))

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced float32 logits for every position of `token_ids` ([T, vocab])."""
        sched = self.scheduler
        req = Req(req_id="score-" + uuid.uuid4().hex, prompt_ids=list(token_ids), sampling=SamplingParams(max_tokens=1))
        sched.validate(req)
        req.table_row = self.runner.page_table.take_row()
        try:
            sched.budget.grow(req, len(token_ids))
            fb = self.runner.build_batch([req.prompt_ids], [0], [req.table_row], [True], False, all_logits=True)
            return self.runner.forward(fb)
        finally:
            sched.budget.release(req)

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[GenerateResult]:
        """Runs every prompt as one concurrent batch (continuous batching) and returns results in order."""
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        reqs = []
        for prompt, sp in zip(prompts, params):
            ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
            req = Req(req_id=uuid.uuid4().hex, prompt_ids=ids, sampling=sp)
            self.scheduler.add(req)
            reqs.append(req)
        while any(not r.finished for r in reqs):
            self.scheduler.step()
            for rid, error in self.scheduler.take_compile_failures():  # a grammar that did not compile
                self.scheduler.abort(rid, "error", error)
            self.scheduler.take_index_events()  # no prefix index listens here: the list would only grow
        results = []
        for r in reqs:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True) if self.tokenizer else None
            results.append(
                GenerateResult(
                    req_id=r.req_id,
                    prompt_ids=r.prompt_ids,
                    output_ids=r.output_ids,
                    finish_reason=r.finish_reason,
                    cached_tokens=r.prefix_hit_len,
                    logprobs=r.output_logprobs,
                    text=text,
                    prompt_logprobs=r.prompt_logprobs,
                    error=r.error,
                )
            )
        return results
