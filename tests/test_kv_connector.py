"""The KV-connector seam (common/sched/kv_connector.py), driven by connectors of the test's own: a prompt
prefilled by one scheduler and decoded by another (its pages copied between the two KV pools as the prefill
side's connector is told them) gives the tokens an aggregated run gives; the page ledger holds throughout,
and held pages come back on abort and when the transfer that holds them finishes.

Tiny random model on the CPU (tests/test_scheduler.py), every step driven by hand.
"""

from __future__ import annotations

import torch

from common.engine.model import DecoderModel
from common.kv.integrity import page_ledger_violations
from common.protocol import SamplingParams
from common.sched.kv_connector import ConnectorSet, FinishedTransfers, KVArrival, KVConnector, combined
from common.sched.request import Req, ReqState
from common.sched.scheduler import Scheduler, SchedulerConfig
from tests.test_scheduler import PAGE, make_engine, prompts


def scheduler(model: DecoderModel, connector: KVConnector | None = None, num_pages: int = 64) -> Scheduler:
    engine = make_engine(model, num_pages=num_pages, max_prefill_tokens=64)
    cfg = SchedulerConfig(max_prefill_tokens=64, itl_target_ms=0)
    return Scheduler(engine.runner, cfg, overlap=False, connector=connector)


def ledger(sched: Scheduler, held: list[Req]) -> list[str]:
    """Every page free, cached, or owned by exactly one request: the active ones and `held` (whose pages a
    connector holds, outside the active set)."""
    live = [*sched.running, *sched.awaiting_kv.values(), *held]
    if sched.chunked is not None:
        live.append(sched.chunked)
    return page_ledger_violations(sched.allocator, sched.cache, ((r.pages, r.tree_pages) for r in live))


def own_pages(sched: Scheduler) -> int:
    """Pages neither free nor in the prefix cache."""
    cached = sched.cache.cached_pages if sched.cache is not None else 0
    return sched.allocator.num_pages - sched.allocator.num_free - cached


class Sender(KVConnector):
    """Prefill side: each chunk's complete pages and then the rest are "sent" (copied into the decode side's
    reserved pages, in order); a prompt done is held until the test finishes its transfer."""

    transfers = True

    def __init__(self) -> None:
        self.src: Scheduler | None = None  # the scheduler asking (set once both exist)
        self.dst: Scheduler | None = None
        self.dst_pages: dict[str, list[int]] = {}
        self.sent: dict[str, list[int]] = {}  # the local pages sent so far, per request
        self.first_tokens: list[KVArrival] = []
        self.done = FinishedTransfers()

    def _send(self, req: Req, upto_pages: int) -> None:
        assert self.src is not None and self.dst is not None
        sent = self.sent.setdefault(req.req_id, [])
        src = req.pages[len(sent) : upto_pages]
        dst = self.dst_pages[req.req_id][len(sent) : upto_pages]
        self.dst.runner.pool.kv[dst] = self.src.runner.pool.kv[src]
        sent.extend(src)

    def chunk_done(self, req: Req, start: int, end: int) -> None:
        if end < req.prompt_len:
            self._send(req, end // PAGE)  # complete pages only

    def prefill_done(self, req: Req) -> bool:
        self._send(req, len(self.dst_pages[req.req_id]))
        lp = req.output_logprobs[0] if req.output_logprobs else None
        self.first_tokens.append(KVArrival(req.req_id, req.output_ids[0], lp, req.prefix_hit_len))
        return True

    def finished(self) -> FinishedTransfers | None:
        done, self.done = self.done, FinishedTransfers()
        return done


class Receiver(KVConnector):
    """Decode side: the requests waiting for pages, the pages each got, arrivals as the test delivers them;
    an aborted request's pages are held while `hold_on_abort` says a write may still land."""

    transfers = True

    def __init__(self) -> None:
        self.waiting: list[Req] = []
        self.pages: dict[str, list[int]] = {}
        self.hold_on_abort = False
        self.done = FinishedTransfers()

    def reservations(self) -> list[Req]:
        return list(self.waiting)

    def reserved(self, req: Req, pages: list[int]) -> None:
        self.waiting.remove(req)
        self.pages[req.req_id] = pages

    def aborted(self, req: Req) -> bool:
        return self.hold_on_abort

    def finished(self) -> FinishedTransfers | None:
        done, self.done = self.done, FinishedTransfers()
        return done


def test_a_prompt_prefilled_by_one_scheduler_decodes_on_another_with_the_aggregated_tokens(
    tiny_model: DecoderModel,
) -> None:
    prompt = prompts(81, [150])[0]  # three chunks of 64 tokens: pages are sent as chunks complete
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = scheduler(tiny_model)
    ref = Req(req_id="ref", prompt_ids=list(prompt), sampling=sampling)
    alone.add(ref)
    while alone.has_work():
        alone.step()

    sender, receiver = Sender(), Receiver()
    prefill, decode = scheduler(tiny_model, sender), scheduler(tiny_model, receiver)
    sender.src, sender.dst = prefill, decode
    dreq = Req(req_id="r", prompt_ids=list(prompt), sampling=sampling)
    receiver.waiting.append(dreq)
    assert decode.settle_transfers() == []  # reserves its pages
    assert dreq.state is ReqState.AWAITING_KV and len(receiver.pages["r"]) == 10  # 150 tokens: 10 pages
    assert ledger(decode, []) == [] and not decode.has_work()
    sender.dst_pages["r"] = receiver.pages["r"]

    preq = Req(req_id="r", prompt_ids=list(prompt), sampling=SamplingParams(max_tokens=1), prefill_only=True)
    prefill.add(preq)
    while not sender.first_tokens:
        prefill.step()
        assert ledger(prefill, [preq] if sender.first_tokens else []) == []
    assert len(sender.sent["r"]) == 10 and not prefill.has_work()
    # Held while its transfer is not over: its pages stay allocated, outside the active set.
    assert preq.finished and own_pages(prefill) == len(preq.pages) - preq.tree_pages > 0
    assert ledger(prefill, [preq]) == []

    receiver.done.arrived.append(sender.first_tokens[0])
    [event] = decode.settle_transfers()
    assert event.req is dreq and event.tokens == ref.output_ids[:1] and dreq.state is ReqState.RUNNING
    while decode.has_work():
        decode.step()
        assert ledger(decode, []) == []
    assert dreq.output_ids == ref.output_ids

    # The transfer finished: the prefill side's pages come back, the prompt's prefix stays cached.
    sender.done.released.append("r")
    assert prefill.settle_transfers() == []
    assert own_pages(prefill) == 0 and prefill.cache is not None and prefill.cache.cached_pages == 150 // PAGE
    assert ledger(prefill, []) == [] and own_pages(decode) == 0
    again = Req(req_id="again", prompt_ids=list(prompt), sampling=SamplingParams(max_tokens=1))
    prefill.add(again)
    while prefill.has_work():
        prefill.step()
    assert again.prefix_hit_len == 150 // PAGE * PAGE


def test_held_pages_come_back_on_abort_and_when_the_transfer_finishes(tiny_model: DecoderModel) -> None:
    receiver = Receiver()
    decode = scheduler(tiny_model, receiver, num_pages=16)
    a, b, c = (
        Req(req_id=rid, prompt_ids=p, sampling=SamplingParams(max_tokens=8, ignore_eos=True))
        for rid, p in zip("abc", prompts(82, [100, 100, 100]))
    )
    receiver.waiting += [a, b, c]
    decode.settle_transfers()
    # 7 pages each (100 tokens, 108 with the outputs): two fit the 16-page pool, the third waits behind them.
    assert a.state is b.state is ReqState.AWAITING_KV and receiver.waiting == [c] and c.state is ReqState.WAITING
    assert own_pages(decode) == len(a.pages) + len(b.pages) == 14 and ledger(decode, []) == []
    snap = decode.snapshot()
    assert (snap.running, snap.waiting, snap.held, snap.free_pages, snap.total_pages) == (2, 0, 0, 2, 16)

    # Aborted while no write can land: its pages are free at once (and `c` gets pages at the next ask).
    event = decode.abort("a")
    assert event is not None and event.finished and a.pages == [] and a.req_id not in decode.held
    decode.settle_transfers()
    assert c.state is ReqState.AWAITING_KV and receiver.waiting == []

    # Aborted while a write may still land: held, not free, until the connector releases it.
    receiver.hold_on_abort = True
    held_pages = list(b.pages)
    assert decode.abort("b") is not None and b.finished and b.pages == held_pages
    assert not bool(decode.allocator.is_free(torch.tensor(held_pages)).any())
    assert ledger(decode, [b]) == []
    snap = decode.snapshot()
    assert (snap.running, snap.held, snap.free_pages) == (1, 1, 16 - 14)  # `c` awaits its KV, `b` is held
    assert decode.abort("b") is None  # already ended: nothing more
    receiver.done.released.append("b")
    assert decode.settle_transfers() == []
    assert b.pages == [] and bool(decode.allocator.is_free(torch.tensor(held_pages)).all())
    assert decode.snapshot().held == 0 and decode.snapshot().free_pages == 16 - 7

    # A released id the scheduler does not hold changes nothing; the last reservation is aborted too.
    receiver.done.released.append("nobody")
    decode.settle_transfers()
    receiver.hold_on_abort = False
    decode.abort("c")
    assert own_pages(decode) == 0 and ledger(decode, []) == []
    assert decode.runner.page_table.num_free_rows == decode.max_running and not decode.held


class Holder(KVConnector):
    """A prefill role in miniature: answers for its own (``prefill_only``) requests only, holding their pages
    once prefilled until the test releases them; records every ask."""

    transfers = True

    def __init__(self) -> None:
        self.chunks: list[tuple[str, int, int]] = []
        self.prefilled: list[str] = []
        self.done = FinishedTransfers()

    def chunk_done(self, req: Req, start: int, end: int) -> None:
        self.chunks.append((req.req_id, start, end))

    def prefill_done(self, req: Req) -> bool:
        self.prefilled.append(req.req_id)
        return req.prefill_only

    def aborted(self, req: Req) -> bool:
        return req.prefill_only

    def reserved(self, req: Req, pages: list[int]) -> None:
        raise AssertionError(f"{req.req_id} was reserved for by the connector that did not list it")

    def finished(self) -> FinishedTransfers | None:
        done, self.done = self.done, FinishedTransfers()
        return done


def test_a_connector_set_asks_every_connector_and_routes_each_answer_to_its_own(tiny_model: DecoderModel) -> None:
    """A mixed worker's scheduler asks both of its roles (common/sched/kv_connector.py ``ConnectorSet``): chunks
    are told to every one, pages are held when one of them holds them, a reservation goes to the role that
    listed it, and the transfers both report finished in one settle: one request joins the batch, the other's
    held pages come back."""
    assert type(combined([])) is KVConnector and not combined([]).transfers
    one = Holder()
    assert combined([one]) is one
    holder, receiver = Holder(), Receiver()
    both = combined([holder, receiver])
    assert isinstance(both, ConnectorSet) and both.finished() is None  # nothing finished: nothing to hand on
    sched = scheduler(tiny_model, both)  # type: ignore[arg-type]
    p_prompt, d_prompt = prompts(83, [100, 40])
    preq = Req(req_id="for-peer", prompt_ids=p_prompt, sampling=SamplingParams(max_tokens=1), prefill_only=True)
    dreq = Req(req_id="from-peer", prompt_ids=d_prompt, sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    receiver.waiting.append(dreq)
    sched.add(preq)
    assert sched.settle_transfers() == []
    assert dreq.state is ReqState.AWAITING_KV and list(receiver.pages) == ["from-peer"]  # the lister's, only

    while not holder.prefilled:
        sched.step()
    assert holder.chunks == [("for-peer", 0, 64), ("for-peer", 64, 100)]  # every connector is told each chunk
    assert preq.finished and preq.pages and ledger(sched, [preq]) == []  # held: one connector said so
    held = list(preq.pages)

    # Both report in the same turn: one merged answer.
    receiver.done.arrived.append(KVArrival("from-peer", 7, None, 0))
    holder.done.released.append("for-peer")
    [event] = sched.settle_transfers()
    assert event.req is dreq and event.tokens == [7] and dreq.state is ReqState.RUNNING
    # Its pages are back: the prompt's full ones in the prefix cache, the rest free.
    assert preq.pages == [] and ledger(sched, []) == [] and own_pages(sched) == len(dreq.pages)
    assert sched.cache is not None and sched.cache.cached_pages == 100 // PAGE
    assert bool(sched.allocator.is_free(torch.tensor(held[100 // PAGE :])).all())
    while sched.has_work():
        sched.step()
        assert ledger(sched, []) == []
    assert len(dreq.output_ids) == 6 and own_pages(sched) == 0

    # An abort is asked of every connector: the one whose request it is holds its pages.
    again = Req(
        req_id="again", prompt_ids=prompts(84, [150])[0], sampling=SamplingParams(max_tokens=1), prefill_only=True
    )
    sched.add(again)
    sched.step()  # its first chunk of three
    assert sched.abort("again") is not None and again.pages and ledger(sched, [again]) == []
    holder.done.released.append("again")
    sched.settle_transfers()
    assert own_pages(sched) == 0 and ledger(sched, []) == []


# The scheduler's surface for the code that serves it: the loop, the connector's settling, the snapshot.
SCHEDULER_SURFACE = {
    "take_compile_failures",
    "compiling_only",
    "prefetch_grammar",
    "add",
    "abort",
    "step",
    "has_work",
    "validate",
    "settle_transfers",
    "snapshot",
    "last_step_kind",
    "has_request",
    "live_request_ids",
    "ledger_violations",
    "cached_block_hashes",
    "take_index_events",
    "seed_prefill_speed",
    "host_tier_locking",
    "lock_host_tier",
}


def test_serving_reads_the_scheduler_only_through_its_surface() -> None:
    """common/worker and the worker packages use `<host>.scheduler.<name>` for the names above only (no field
    of the scheduler, no alias that would hide one), and each of those names is a public method of it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = [
        p
        for d in ("common/worker", "prefill_worker", "decode_worker", "mixed_worker")
        for p in (root / d).rglob("*.py")
    ]
    assert len(files) > 10
    used, wrong = set(), []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)):
                continue
            if node.value.attr == "scheduler":  # self.scheduler.<name> (the host), self.host.scheduler.<name> (a role)
                used.add(node.attr)
                if node.attr not in SCHEDULER_SURFACE:
                    wrong.append(f"{path.relative_to(root)}:{node.lineno}: scheduler.{node.attr}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and ast.unparse(node.value).endswith(".scheduler"):
                wrong.append(f"{path.relative_to(root)}:{node.lineno}: an alias of self.scheduler")
    assert wrong == []
    assert {"step", "snapshot", "settle_transfers"} <= used
    for name in SCHEDULER_SURFACE:
        assert callable(getattr(Scheduler, name)) and not name.startswith("_"), name
