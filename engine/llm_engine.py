"""The synchronous engine core: requests in, one scheduled step at a time, outputs out.

`LLM` (offline) drives it in a loop; `AsyncLLM` runs the same loop in a thread and feeds
per-request streams. Bad input is rejected in `add_request` before anything is
scheduled, so one bad request never disturbs the others.
"""

from __future__ import annotations

import logging
import time

import torch

from kvray.engine.block_pool import KVCacheStats
from kvray.engine.config import EngineConfig
from kvray.engine.draft_proposer import DraftProposer
from kvray.engine.engine_stats import EngineStats, StepStats, engine_stats
from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.kv_handoff import KVHandoff, LeasePolicy, PinTable
from kvray.engine.kv_transfer import KVLayout, KVTicket, kv_layout_of
from kvray.engine.model_runner import build_runner, resolve_max_model_len
from kvray.engine.output_processor import OutputProcessor
from kvray.engine.outputs import RequestOutput, TokenLogprobs
from kvray.engine.request import Request, RequestStatus
from kvray.engine.request_intake import PromptInput, RequestIntake
from kvray.engine.request_limits import RequestLimits
from kvray.engine.sampling_params import SamplingParams
from kvray.engine.scheduler import Scheduler
from kvray.engine.spec_decode import SpecDecodeStats
from kvray.engine.speculator import Speculator
from kvray.engine.step_sampling import cause
from kvray.errors import InvalidArgumentError
from kvray.models.loader import load_config, load_tokenizer, resolve_model_path
from kvray.models.parallel import ShardContext

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        hf_config=None,
        model_path=None,
        tokenizer=None,
        shard: ShardContext | None = None,
        draft_hf_config=None,
        lease: LeasePolicy | None = None,
    ):
        """Build from `config.model`; tests may pass `hf_config` (random weights, no path),
        and `draft_hf_config` for a draft_model proposer's.

        Under tensor/pipeline parallelism this engine is the group's driver shard (rank 0
        of `shard`): it schedules, and its runner sends each step to the other shards.
        """
        shard = shard or ShardContext()
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        if shard.spec.world_size != world:
            raise InvalidArgumentError(
                "tensor_parallel_size",
                f"{config.tensor_parallel_size} x pipeline_parallel_size {config.pipeline_parallel_size}",
                "1 x 1 for a single-process LLMEngine (shard groups run as Ray actors: "
                "use LLM(...) or a kvray worker)",
            )
        self.config = config
        torch.manual_seed(config.seed)
        if hf_config is None:
            model_path = resolve_model_path(config.model)
            hf_config = load_config(model_path)
            if tokenizer is None:
                tokenizer = load_tokenizer(model_path)
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        spec = config.speculative_config
        drafter = None  # a draft model's cache shares the target's blocks: both count in the budget
        if spec is not None and spec.method == "draft_model":
            drafter = DraftProposer(
                spec, config, hf_config, resolve_max_model_len(config, hf_config), draft_hf_config
            )
        extra = drafter.bytes_per_block if drafter is not None else None
        self.runner = build_runner(config, hf_config, model_path, shard, extra_bytes_per_block=extra)
        if drafter is not None:
            drafter.start(self.runner.num_blocks)
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.max_model_len = self.runner.max_model_len
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        # every KV hand-off here: prompts held for a decode worker's pull (the scheduler
        # asks it at each finish), and pulls arriving into blocks reserved here
        # (`lease`: the hand-off's timing rules, the worker's; default LeasePolicy())
        self.handoff = KVHandoff(self.kv, config.block_size, lease)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.scheduling_policy,
            connector=self.handoff,
        )
        self.outputs = OutputProcessor(tokenizer)
        self.limits = RequestLimits.of(config, hf_config.vocab_size, self.max_model_len)
        self.intake = RequestIntake(tokenizer, hf_config, model_path, self.limits, config.block_size)
        self.grammars = self.intake.grammars
        self.speculator = Speculator(spec, self.max_model_len, drafter) if spec is not None else None
        self.spec_stats = self.speculator.stats if self.speculator is not None else SpecDecodeStats()
        self.last_step: StepStats | None = None
        self.last_shape: list[tuple[int, int, bool]] | None = None  # the last step's batch, when traced
        self.pending_outputs: list[RequestOutput] = []  # produced outside step(), e.g. by adds

    def shutdown(self) -> None:
        """Release the group's other shards (their serve loops return)."""
        self.runner.stop_shards()

    # ---- requests -------------------------------------------------------------------

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        return self.intake.tokenize(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.intake.validate(prompt_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
        pin_kv: bool = False,
        generated_token_ids: list[int] | None = None,
        matchers: list | None = None,
    ) -> None:
        """Queue a request. With `pin_kv` it is a prefill for a decode worker: when it
        finishes, its blocks stay pinned for the lease policy's `lease_s` (see `kv_ticket`).

        `generated_token_ids`: tokens the request already made on an engine that has gone
        (migration). They are recomputed here with the prompt (prefix cache where it has
        them), count towards `max_tokens`, `min_tokens` and the penalties, and a seeded
        request draws the numbers it would have drawn; its outputs go on from the next
        token (a DELTA output never repeats them).

        `matchers`: the samples' grammar matchers, built by the caller (AsyncLLM builds them
        off the step loop); None: built here where the request has a grammar."""
        generated = list(generated_token_ids or [])
        if generated and params.n != 1:
            raise InvalidArgumentError("n", params.n, "1 for a resumed request")
        samples = self._make_samples(
            request_id, prompt, params, priority, deadline, generated, matchers=matchers
        )
        if generated:
            (req,) = samples
            self.outputs.replay(req, generated)
            reason = self.scheduler.stop_reason(req)
            if reason is not None:  # it had already ended: say so now
                req.status = reason
                self.pending_outputs.append(self.outputs.output(request_id))
                return
        for s in samples:
            if pin_kv:
                self.handoff.expect(s.request_id)
            self.scheduler.add_request(s)

    def _make_samples(
        self, request_id, prompt, params, priority, deadline, generated=(), made_elsewhere=None, matchers=None
    ) -> list[Request]:
        """The request's n samples, tracked for output. `made_elsewhere`: tokens it already
        has (default `generated`), which its grammar replays."""
        text, ids = self.intake.tokenize(prompt)
        self.intake.validate(ids + list(generated), params)
        sample_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        busy = self.outputs.tracked.keys() | self.outputs.sample_to_parent.keys()
        if any(i in busy or i in self.handoff for i in (request_id, *sample_ids)):
            raise InvalidArgumentError("request_id", request_id, "an id not in flight or pinned")
        replayed = list(generated if made_elsewhere is None else made_elsewhere)
        samples = self.intake.samples(sample_ids, text, ids, params, priority, deadline, replayed, matchers)
        self.outputs.add(request_id, samples)
        return samples

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish the requests as `abort` and free their blocks now; returns their final
        outputs, each after any output of that request still pending (not yet returned by
        `step`), so a DELTA stream never loses a piece."""
        finals = []
        for rid in request_ids:
            samples = self.outputs.samples_of(rid)
            if not samples:
                continue
            self.handoff.abort(rid)  # a pull writing into its blocks frees them as it ends
            self.scheduler.abort([s.request_id for s in samples])
            for s in samples:
                self._forget(s.request_id)
            finals += [o for o in self.pending_outputs if o.request_id == rid]
            self.pending_outputs = [o for o in self.pending_outputs if o.request_id != rid]
            finals.append(self.outputs.output(rid))  # finished: never None
        return finals

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.handoff.num_pulling > 0

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return outputs of requests that moved."""
        self.expire_kv_leases()
        pending = self.take_pending_outputs()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.fill(sched, self.kv)
        self.last_step = StepStats(
            sched.total_tokens, len(self.scheduler.running), len(self.scheduler.waiting)
        )
        self.last_shape = sched.shape() if self.config.step_trace_dir else None
        if not sched.requests:
            return pending
        start = time.perf_counter()
        tables = [self.kv.block_ids(r.request_id) for r in sched.requests]
        result = self.runner.execute(sched, tables)
        share = (time.perf_counter() - start) / len(sched.requests)
        for req in sched.requests:
            req.step_seconds += share
        failed = dict(result.errors)
        sampled = {rid: t for rid, t in zip(result.request_ids, result.token_ids) if rid not in failed}
        logprobs = dict(zip(result.request_ids, result.logprobs))

        def on_token(req: Request, j: int) -> None:
            """The engine's checks of a request's j-th new token of this step; a check
            that fails ends this request alone."""
            try:
                if req.grammar is not None and not req.grammar.accept(req.output_token_ids[-1]):
                    logger.error("kvray engine: %s sampled a token its grammar refuses", req.request_id)
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                stop = self.outputs.on_token(req, logprobs[req.request_id][j])
            except Exception as e:
                failed[req.request_id] = cause(e)
                self._fail_request(req, failed[req.request_id])
                return
            if stop is not None and not req.finished:
                req.stop_reason = stop
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)

        advanced = self.scheduler.update_from_output(sched, sampled, on_token)
        if self.speculator is not None:
            self.speculator.settle(sched, sampled)
        touched: dict[str, None] = {}
        for req in advanced:
            if req.finished:
                self._forget(req.request_id)
            touched[self.outputs.parent_of(req.request_id)] = None
        for req in sched.requests:  # rows that failed in the runner: those requests end here
            if req.request_id in failed and req.status is not RequestStatus.FINISHED_ERROR:
                self._fail_request(req, failed[req.request_id])
                self._forget(req.request_id)
                touched[self.outputs.parent_of(req.request_id)] = None
        outputs = (self.outputs.output(rid) for rid in touched)  # None: FINAL_ONLY, running
        return pending + [o for o in outputs if o is not None]

    def _fail_request(self, req: Request, why: str) -> None:
        """End one request alone as FINISHED_ERROR (something of its own failed in the
        step; the cause logged with its id): its blocks are freed, a pin of them let go."""
        logger.error("kvray engine: request %s failed: %s", req.request_id, why)
        if req.group is not None:
            req.group.prompt_done = True  # its siblings wait for its prompt no longer
        if req.finished:  # a stop or its length had ended it this step: its blocks are back
            req.status = RequestStatus.FINISHED_ERROR
            self.handoff.release(req.request_id)  # (a prefill's pin of them, if any)
        else:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)

    def _forget(self, request_id: str) -> None:
        """Drop a finished request's per-request state in the runner (and the draft's)."""
        self.runner.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def kv_cache_stats(self) -> KVCacheStats:
        return self.kv.stats()

    def stats(self) -> EngineStats:
        return engine_stats(self)

    def take_pending_outputs(self) -> list[RequestOutput]:
        pending, self.pending_outputs = self.pending_outputs, []
        return pending

    # ---- disaggregation: the prefill side -----------------------------------------------

    @property
    def kv_layout(self) -> KVLayout:
        runner = self.runner
        return kv_layout_of(self.hf_config, runner.spec, self.config.block_size, self.dtype, runner.kv_quant)

    @property
    def pins(self) -> PinTable:
        """Prefilled prompts' blocks pinned for a pull (readable from any thread)."""
        return self.handoff.pins

    def kv_ticket(self, worker_id: str, request_id: str) -> KVTicket | None:
        """The ticket of a finished prefill (None if its blocks are not pinned)."""
        return self.handoff.ticket(worker_id, request_id, self.kv_layout)

    def release_kv(self, request_id: str) -> bool:
        """The decode side has the blocks (or gave up): unpin them. Engine thread only."""
        return self.handoff.release(request_id)

    def expire_kv_leases(self) -> None:
        self.handoff.expire(time.time())

    def handoff_step(self, now: float | None = None) -> list[tuple[str, list[int] | None]]:
        """Between steps (KVHandoff.on_step): pins whose lease ended go back to the pool;
        requests waiting for room to pull into get blocks freed since, before the next
        step's new requests: (request id, blocks to pull into, then `finish_kv_pull`), or
        (request id, None) for one that will not pull (aborted, or queued here for
        recompute as its pin is about to lapse). None go out while a preempted request
        waits to come back: it has computed more than a prompt."""
        may_allocate = not any(r.num_preemptions for r in self.scheduler.waiting)
        step = self.handoff.on_step(time.time() if now is None else now, may_allocate)
        for req in step.recompute:
            self.scheduler.add_request(req)
        return step.rooms

    # ---- disaggregation: the decode side ------------------------------------------------

    def add_prefilled_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        priority: int = 0,
        pull_deadline: float | None = None,
        matchers: list | None = None,
    ) -> list[int] | None:
        """Continue a request whose prompt was prefilled elsewhere and whose first token
        was sampled there. Returns the blocks to pull the prompt's KV into, then call
        `finish_kv_pull`; None when there are none now: the first token ended the request,
        or no blocks are free. Then, with a `pull_deadline` (the ticket's: wall-clock time
        when the prefill's pin lapses, counted no later than this host's own count of the
        lease, `LeasePolicy.pin_end`) still ahead, it waits for blocks (`waits_for_room`) and
        `handoff_step` hands them out as they free up (vLLM's decode side waits so too);
        without, or once it is too near, the prompt is queued for recompute here.

        The first token's output (final if it ended the request) goes to
        `pending_outputs`, made like every later one: the same stop strings, hold-back
        and output kind (none for a FINAL_ONLY request that continues)."""
        if params.n != 1:
            raise InvalidArgumentError("n", params.n, "1 for a disaggregated request")
        # the prefill sampled the first token under the same grammar: replay it
        (req,) = self._make_samples(
            request_id, prompt, params, priority, None, made_elsewhere=[first_token], matchers=matchers
        )
        req.append_token(first_token)
        stop = self.outputs.on_token(req, first_logprobs)
        reason = RequestStatus.FINISHED_STOPPED if stop is not None else self.scheduler.stop_reason(req)
        if reason is not None:
            req.stop_reason = stop if stop is not None else req.stop_reason
            req.status = reason
        first = self.outputs.output(request_id)
        if first is not None:
            self.pending_outputs.append(first)
        if reason is not None:
            return None
        now = time.time()
        pin_end = None if pull_deadline is None else self.handoff.policy.pin_end(pull_deadline, now)
        blocks = self.handoff.admit_prefilled(req, pin_end, now)
        if blocks is None and not self.waits_for_room(request_id):
            self.scheduler.add_request(req)  # recomputed here
        return blocks

    def waits_for_room(self, request_id: str) -> bool:
        """Whether a prefilled request waits for blocks to pull its prompt into."""
        return self.handoff.waits(request_id)

    def finish_kv_pull(self, request_id: str, ok: bool) -> None:
        """The pull into the reserved blocks finished (ok) or failed (recompute here)."""
        req = self.handoff.finish_pull(request_id, ok)
        if req is None:  # unknown, or aborted during the pull (its blocks freed now)
            return
        if ok:
            self.scheduler.add_running(req)
        else:
            self.scheduler.add_request(req)

    @property
    def num_kv_recomputes(self) -> int:
        return self.handoff.num_recomputes
