from __future__ import annotations

import torch

from common.engine.runner import ModelRunner
from common.offline import Engine
from common.settings import SchedulerConfig

# A grammar's first compile builds the tokenizer's tables (seconds on a busy 2-core box): a test that is not about
# the compile deadline must not fail on it.
TEST_GRAMMAR_COMPILE_TIMEOUT_S = 120.0


def fresh_engine(runner: ModelRunner, max_prefill_tokens: int = 2048, prefix_cache: bool = True) -> Engine:
    """A new scheduler (empty prefix cache, all pages free) over a shared, already-loaded runner."""
    return Engine(
        runner=runner,
        sched_cfg=SchedulerConfig(
            max_prefill_tokens=max_prefill_tokens,
            enable_prefix_cache=prefix_cache,
            grammar_compile_timeout_s=TEST_GRAMMAR_COMPILE_TIMEOUT_S,
        ),
        load_tokenizer=False,
    )


@torch.inference_mode()
def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt_ids) :].tolist()


def assert_pool_clean(engine: Engine) -> None:
    """Every page is either free or held by the prefix cache, and nothing in the cache is locked."""
    sched = engine.scheduler
    cached = sched.cache.cached_pages if sched.cache is not None else 0
    protected = sched.cache.protected_pages if sched.cache is not None else 0
    assert protected == 0
    assert sched.allocator.num_free + cached == sched.allocator.num_pages
    assert sched.runner.page_table.num_free_rows == sched.runner.cfg.max_running


def story_prompts(tokenizer, topics: list[str]) -> list[list[int]]:
    """Chat prompts asking for a long story about each topic: long answers from short, distinct prompts."""
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Write a long story about {t}."}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for t in topics
    ]
