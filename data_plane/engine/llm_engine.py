"""LLMEngine: the synchronous core — admit requests, run steps, hand back per-request outputs.

Only the engine thread calls it (see async_engine.py); it holds no locks.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from data_plane.config import EngineConfig
from data_plane.engine.admission import validate_request
from data_plane.engine.batch_builder import BatchBuilder, sampling_rows
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.model_runner import ModelRunner
from data_plane.engine.output_processor import OutputProcessor
from data_plane.engine.outputs import RequestOutput
from data_plane.engine.prefill_pacer import PrefillPacer
from data_plane.engine.sampling_params import sample_seed
from data_plane.engine.scheduler import Scheduler, SchedulerOutput
from data_plane.engine.sequence import FinishReason, Request, Sequence
from data_plane.engine.worker import build_runner
from data_plane.lora.slots import LoRAEngineStats, LoRASlotManager
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.model.sampler import Sampler, SamplingRow
from data_plane.structured.grammar import MatcherCache, grammar_text
from data_plane.tokenizer import Tokenizer
from shared.errors import EngineDeadError, InvalidRequestError, OverloadedError

logger = logging.getLogger(__name__)
# One DEBUG line per step (`--log-level debug`): "step decodes=D prefill_tokens=P ms=T", T the step's wall time
# from scheduling to its outputs (bench/peer.py reads the decode-only steps' median); off, it costs one check.
STEP_LOGGER = "data_plane.engine.steps"
_step_log = logging.getLogger(STEP_LOGGER)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    lora: LoRAEngineStats  # with LoRA off: no slots and no adapters (slots_total == 0)
    # steps by how many distinct adapters they ran (the base model not counted), from StepInput.adapter_ids
    step_adapters: dict[int, int] = field(default_factory=dict)


@dataclass
class _RequestState:
    request: Request
    seqs: list[Sequence]
    arrival_step: int  # steps the engine had run when the request arrived
    first_token_steps: int | None = None  # steps from its arrival to its first token, that one's included

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        vocab_size: int,
        lora_slots: LoRASlotManager | None = None,
    ) -> None:
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.lora_slots = lora_slots
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, lora_slots,
            enable_chunked_prefill=config.enable_chunked_prefill,
            prefill_pacer=PrefillPacer(config.decode_stall_limit) if config.decode_stall_limit else None,
            long_prefill_tokens=config.long_prefill_token_threshold,
        )
        self.builder = BatchBuilder(config.block_size, runner.device, lora_slots, fold_chunks=runner.reads_kv_in_place)
        self.sampler = Sampler(tokenizer.eos_token_ids)
        self.grammars = MatcherCache(tokenizer, vocab_size, config.structured_output_cache_size)
        self.outputs = OutputProcessor(tokenizer, config.max_model_len)
        self.requests: dict[str, _RequestState] = {}
        self._seq_ids = itertools.count()
        self.step_adapters: dict[int, int] = {}  # see EngineStats.step_adapters
        self.num_steps = 0  # batches run

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the model and tokenizer named by the config (slow: reads the checkpoint)."""
        built = build_runner(config, rank=0)  # spawns the other ranks of a tensor-parallel engine
        assert config.tokenizer is not None  # EngineConfig.__post_init__ defaults it to the model
        tokenizer = Tokenizer.from_pretrained(config.tokenizer)
        engine = cls(config, built.runner, tokenizer, built.model_config.vocab_size, built.lora_slots)
        engine.grammars.warm()
        return engine

    # ---- requests ------------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Reject what can never be served, before it is queued (→ HTTP 400)."""
        validate_request(request, self.config, self.vocab_size)
        prompt_len = len(request.prompt_token_ids)
        if request.adapter_id != 0:
            if self.lora_slots is None:
                raise InvalidRequestError("LoRA is not enabled on this engine; start it with --enable-lora.")
            if request.lora is None or request.lora.description.rank > self.config.max_lora_rank:
                raise InvalidRequestError(f"Adapter {request.adapter_id} has no weights that fit the LoRA slots.")
        blocks = self.block_manager.blocks_needed(prompt_len + 1)
        if blocks > self.block_manager.num_blocks - self.block_manager.watermark:
            raise InvalidRequestError(
                f"The prompt needs {blocks} KV blocks but the cache holds {self.block_manager.num_blocks}; "
                "shorten the prompt or start the engine with a larger --kv-cache-memory-mb.",
                param="prompt",
            )

    def add_request(self, request: Request) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[Request]) -> None:
        """The requests of one API request, all or nothing: every one is checked and every sequence built
        first, and only then does any reach the scheduler, so a group refused here leaves no sequence behind
        that a later step would trip over."""
        seen: set[str] = set()
        for request in requests:
            self.validate(request)
            if request.request_id in self.requests or request.request_id in seen:
                raise InvalidRequestError(f"Request id {request.request_id!r} is already in use.")
            seen.add(request.request_id)
        states = [self._state(request) for request in requests]
        for state in states:
            self.requests[state.request.request_id] = state
            for seq in state.seqs:
                self.scheduler.add(seq)

    def _state(self, request: Request) -> _RequestState:
        """The request's sequences, built; its adapter's slot image on its way."""
        if request.lora is not None and self.lora_slots is not None and not self.lora_slots.is_resident(request.adapter_id):
            # the slot image (padded, cast, scale folded in) is made outside any step, so the step that admits
            # the request copies one row into the slot pool instead of building it: now when nothing runs,
            # else on the image thread, paced, and the request waits for it (scheduler.py) while the
            # running streams' steps go on
            if self.scheduler.running:
                self.lora_slots.prepare_soon(request.lora)
            else:
                self.lora_slots.prepare(request.lora)
        params = request.sampling_params
        grammar = None
        if params.structured_outputs is not None:
            try:  # the API process sends the grammar it checked; a request made without one gets it here
                grammar = request.grammar or grammar_text(params.structured_outputs.constraint())
            except ValueError as exc:
                raise InvalidRequestError(f"The structured_outputs constraint is not valid: {exc}",
                                          param="structured_outputs") from None
        seqs = []
        for index in range(params.n):
            seq = Sequence(next(self._seq_ids), request, index)
            if params.seed is not None:
                seq.generator = torch.Generator(self.runner.device).manual_seed(sample_seed(params.seed, index))
            if grammar is not None:
                seq.matcher = self.grammars.new(grammar)  # a 400 when llguidance rejects the grammar
            seqs.append(seq)
        return _RequestState(request, seqs, self.num_steps)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.get(request_id)
        if state is None:
            return None
        return self._fail(state, FinishReason.ABORT, error=None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self._fail_unschedulable()
        outputs = self._run(sched)
        if self.scheduler.prefill_pacer is not None:
            prefill_tokens = sum(item.num_new_tokens for item in sched.prefills)
            self.scheduler.prefill_pacer.observe(len(sched.decodes), prefill_tokens, time.perf_counter() - started)
        if _step_log.isEnabledFor(logging.DEBUG):
            _step_log.debug("step decodes=%d prefill_tokens=%d ms=%.3f", len(sched.decodes),
                            sum(item.num_new_tokens for item in sched.prefills), 1000 * (time.perf_counter() - started))
        return outputs

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        scheduled = sched.decodes + [item.seq for item in sched.prefills]
        try:
            step_input, seqs = self.builder.build(sched)  # seqs: those sampled, in logits-row order
            used = len({a for a in step_input.adapter_ids if a})
            self.step_adapters[used] = self.step_adapters.get(used, 0) + 1
            self.num_steps += 1
            logits = self.runner.forward(step_input)  # [S, vocab]
            rows = sampling_rows(seqs)
            dead_ends = self._grammar_masks(seqs, rows)  # while the device computes the logits
            sampled = self.sampler(logits, rows) if seqs else None
        except EngineDeadError:  # a tensor-parallel rank is gone: nothing can run any more
            raise
        except Exception as exc:  # a failing batch fails its requests, never the engine
            logger.exception("step failed; failing the %d requests of this batch", len(scheduled))
            return self.fail_requests({s.request.request_id for s in scheduled}, exc)

        for seq in sched.decodes:
            seq.num_computed_tokens = len(seq)
        for item in sched.prefills:  # a chunk short of the prompt's end samples nothing yet
            item.seq.num_computed_tokens += item.num_new_tokens
        for seq in scheduled:
            self.block_manager.cache_full_blocks(seq)
        touched: dict[str, _RequestState] = {}
        failed: dict[str, RequestOutput] = {}  # requests whose grammar came to a dead end this step
        for row, seq in enumerate(seqs):
            assert sampled is not None
            request_id = seq.request.request_id
            if request_id in failed:
                continue
            token_id = sampled.token_ids[row]
            matcher = seq.matcher
            if matcher is not None and (row in dead_ends or not matcher.advance(token_id)):
                touched.pop(request_id, None)
                failed[request_id] = self._grammar_dead_end(self.requests[request_id], matcher.error)
                continue
            self.outputs.append_token(seq, token_id, sampled.logprobs[row] if sampled.logprobs else None,
                                      grammar_done=matcher is not None and matcher.done)
            if seq.is_finished:
                self.scheduler.remove(seq)
            touched[request_id] = self.requests[request_id]
        return [self._collect(state) for state in touched.values()] + list(failed.values())

    def _grammar_masks(self, seqs: list[Sequence], rows: list[SamplingRow]) -> set[int]:
        """Give each constrained row its grammar's allowed tokens; answers the rows whose grammar allows none
        (they sample unmasked, and their request then fails)."""
        constrained = [(row, seq.matcher) for row, seq in enumerate(seqs) if seq.matcher is not None]
        if not constrained:
            return set()
        masks = self.grammars.masks([matcher for _, matcher in constrained])
        for (row, _), mask in zip(constrained, masks, strict=True):
            rows[row].allowed_tokens = mask
        return {row for (row, _), mask in zip(constrained, masks, strict=True) if mask is None}

    def _grammar_dead_end(self, state: _RequestState, reason: str) -> RequestOutput:
        """The request's grammar allows no token (or not the one sampled): it fails, the batch goes on."""
        logger.info("request %s: its structured output's grammar came to a dead end: %s", state.request.request_id, reason)
        output = self._fail(state, FinishReason.ERROR, error=f"structured output dead end: {reason}")
        output.client_error = InvalidRequestError(
            f"The structured output's grammar allows no further token here: {reason}", param="structured_outputs",
            code="structured_output_dead_end")
        return output

    def fail_requests(self, request_ids: set[str], exc: BaseException) -> list[RequestOutput]:
        """Fail these requests (those still known) with an engine error; their blocks are freed."""
        error = f"engine error: {type(exc).__name__}: {exc}"
        states = [self.requests[r] for r in request_ids if r in self.requests]
        return [self._fail(state, FinishReason.ERROR, error=error) for state in states]

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """Fail every request in flight: what the loop does when a step fails outside a batch. A
        sequence that belongs to no known request is dropped too, so the same fault cannot recur
        on every step."""
        outputs = self.fail_requests(set(self.requests), exc)
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.request.request_id not in self.requests:
                self.scheduler.remove(seq)
        return outputs

    def _collect(self, state: _RequestState) -> RequestOutput:
        deltas = [d for d in (self.outputs.take_delta(s) for s in state.seqs) if d is not None]
        finished = state.finished
        if finished:
            del self.requests[state.request.request_id]
        first_token_steps = None
        if state.first_token_steps is None and any(d.token_ids for d in deltas):
            first_token_steps = state.first_token_steps = self.num_steps - state.arrival_step
        return RequestOutput(
            request_id=state.request.request_id,
            prompt_token_ids=state.request.prompt_token_ids,
            deltas=deltas,
            finished=finished,
            num_cached_tokens=max(s.num_cached_tokens for s in state.seqs),
            first_token_steps=first_token_steps,
        )

    def _fail(self, state: _RequestState, reason: FinishReason, error: str | None) -> RequestOutput:
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish(reason)
        output = self._collect(state)
        output.error = error
        return output

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing runs and the head of the queue still cannot start: it never will, so fail it."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        state = self.requests[seq.request.request_id]
        if self.block_manager.plan_allocation(seq) is None:  # grown longer than the whole KV cache
            logger.warning("sequence %d needs more KV blocks than the cache has; failing it", seq.seq_id)
            return [self._fail(state, FinishReason.LENGTH, error=None)]
        # nothing runs, so no slot is busy: every slot must hold a pinned adapter
        output = self._fail(state, FinishReason.ERROR, error="every LoRA slot is pinned")
        output.client_error = OverloadedError(
            f"Every one of the {self.config.max_loras} LoRA slots holds a pinned adapter, so this adapter "
            "cannot be scheduled; unpin one (load it again with pinned=false) or raise --max-loras."
        )
        return [output]

    # ---- adapters (see data_plane/lora/slots.py) ----------------------------------------------
    def pin_lora(self, adapter_id: int, weights: LoRAAdapterWeights) -> None:
        self._require_lora().pin(adapter_id, weights, {s.adapter_id for s in self.scheduler.running})

    def unpin_lora(self, adapter_id: int) -> None:
        self._require_lora().unpin(adapter_id)

    def remove_lora(self, adapter_id: int) -> None:
        self._require_lora().remove(adapter_id)

    def _require_lora(self) -> LoRASlotManager:
        if self.lora_slots is None:
            raise InvalidRequestError("LoRA is not enabled on this engine; start it with --enable-lora.")
        return self.lora_slots

    def shutdown(self) -> None:
        if self.runner.tp_group is not None:
            self.runner.tp_group.shutdown()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            prefix_cache_queried_tokens=bm.stats.queried_tokens,
            prefix_cache_hit_tokens=bm.stats.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            step_adapters=dict(self.step_adapters),
            lora=(
                self.lora_slots.snapshot(*self.scheduler.adapter_counts())
                if self.lora_slots
                else LoRAEngineStats(slots_total=0, slots_used=0, adapters={})
            ),
        )
