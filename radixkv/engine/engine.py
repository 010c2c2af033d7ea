"""Engine: requests in, incremental token outputs out, one step at a time.

Each step: schedule (running first, then admissions; preemption when the pool is full), then
compute and apply. Compute runs the COW copies, the forward and the sampler and changes
nothing the step is judged by: KV slot writes and block copies are redone identically when
a step is computed again, and the extra samples of a request whose prompt just finished are
plain Sequence objects until applied. Apply commits what was computed to the radix cache,
forks those samples, appends the sampled tokens and checks stop conditions. Beam search
requests skip the sampler: their beams' log-probs go to the beam driver (beam_search.py),
which forks and drops the group's sequences through `_GroupOps` (ref counts only).

Who owns what in a step: the cache manager owns each running sequence's blocks and computed
tokens (the engine's Sequence reads them there) and is written only through the scheduler
(admit, reserve, fork, free) and `_commit` here; the runner owns the device-side mirror of
the block tables and drops a sequence's row when the scheduler's output says it was freed.

NOTE: one request must not take the engine, and every other request, down with it. An
exception in compute cannot be tied to a request, so the step is computed again in halves
(a request's beams and samples stay together) down to the requests that fail alone; those
finish with "error", every other request gets this step's result as if nothing had happened
(seeded samples draw the same: sampler.DrawLog), and a failure that needs the whole batch
(out of memory) is survived too. Apply and output building go request by request: what
raises there fails that request only. An exception in schedule() fails every unfinished
request. After any failure the cache's invariants are checked. What no request caused, a
broken cache or a device-level error (errors.is_device_error), is raised from step(): the
caller must stop. The hot path pays one try block per step, and the try blocks around each
request's apply cost nothing until they catch (Python >= 3.11).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import asdict, dataclass, field

import torch

from radixkv.engine.beam_search import BeamSearch, worst_case_blocks
from radixkv.engine.config import EngineConfig
from radixkv.engine.errors import is_device_error
from radixkv.engine.metrics import EngineCounters, EngineMetrics
from radixkv.engine.model_runner import ModelRunner
from radixkv.engine.outputs import CompletionOutput, RequestOutput, failed_output, request_output
from radixkv.engine.sampler import DrawnTokens, Sampler
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.sequence import Request, Sequence, Status
from radixkv.engine.structured import Grammars, accept
from radixkv.engine.validate import RequestLimits, validate_request
from radixkv.models.config import load_model_config

logger = logging.getLogger("radixkv.engine")

__all__ = ["Engine", "EngineConfig", "RequestOutput", "CompletionOutput", "SamplingParams"]


# NOTE: the overlapped loop (EngineConfig.async_scheduling, on by default on CUDA) launches step
# N+1 before step N's tokens are on the host. Each sequence that samples at step N gets this
# id as its last token until then: the scheduler counts it, the batch carries it, and the runner
# replaces it on the device with step N's drawn token (runner.execute's feed). Step N's tokens
# are settled (appended for real, stop conditions checked, outputs built) while step N+1 runs.
# A sequence that finished at step N may thus be computed once more at N+1: that row is
# discarded and never committed; its blocks were freed when it finished. Steps that need the
# token values on the host run synchronously (after settling): beam search (the next beams are
# chosen on the host), penalties (they count the output tokens' ids) and structured outputs (a
# row's grammar mask is filled from a matcher that must have accepted the last token).
PENDING_TOKEN = -1


@dataclass
class StepResult:
    """What compute produced for some of a step's sequences, before apply."""

    scheduled: list[tuple[Sequence, int]]
    num_tokens: int  # tokens in the forward
    samples: list[Sequence] = field(default_factory=list)  # rows of `drawn`, new samples included
    drawn: DrawnTokens | None = None
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, new sample)
    beams: list[tuple[Request, torch.Tensor]] = field(default_factory=list)  # log-probs [beams, vocab]

    def feed_rows(self, seqs) -> list[int]:
        """Rows of `drawn` holding the pending last token of each of `seqs` that has one."""
        row_of = {id(s): i for i, s in enumerate(self.samples)}
        return [row_of[id(s)] for s in seqs if s.token_ids[-1] == PENDING_TOKEN]


class Engine:
    def __init__(self, config: EngineConfig):
        from radixkv.cache import KVCacheManager

        self.config = config
        self.model_config = load_model_config(config.model_dir)
        self.device = config.resolved_device()
        self.runner = ModelRunner(config, self.model_config, self.device)
        self.block_size, self.num_blocks = config.block_size, self.runner.num_blocks
        self.max_model_len = self.runner.max_model_len
        self.cache = KVCacheManager(self.num_blocks, self.block_size, hash_algo=config.hash_algo,
                                    hash_seed=config.hash_seed, enable_prefix_caching=config.enable_prefix_caching,
                                    enable_events=config.enable_cache_events)
        self.scheduler = Scheduler(self.cache, block_size=self.block_size, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_prefill_chunk=config.max_prefill_chunk, policy=config.scheduling_policy,
                                   defer_shared_prefill=config.enable_prefix_caching, num_blocks=self.num_blocks)
        self._group_ops = _GroupOps(self)
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else self.runner.device.type == "cuda"
        self._pending: StepResult | None = None  # launched, its tokens not settled yet (overlapped loop)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        # what a new request is checked against (validate_request); fixed once the pool is sized
        self.limits = RequestLimits(self.model_config.vocab_size, self.max_model_len, self.runner.max_positions,
                                    self.num_blocks, self.block_size, config.max_num_seqs, tuple(self.eos_token_ids))
        self.sampler = Sampler(self.device, self.model_config.eos_token_ids, config.seed)
        # structured outputs: the tokenizer and the grammar compiler are loaded at the first constrained request
        self.grammars = Grammars(config.model_dir, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self._draws = self.sampler.draws  # apart: profilers wrap self.sampler in a plain function
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._news: dict[str, Request] = {}  # requests with outputs to report (aborts, between steps)
        self._failed: set[str] = set()  # of those, the ones the engine failed
        self._idle_checked = True
        self.counters = EngineCounters()

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        params = SamplingParams() if params is None else params
        validate_request(self.limits, request_id, prompt_token_ids, params, cache_salt, self.requests)
        req = Request(request_id, list(prompt_token_ids), params, next(self._arrivals), cache_salt)
        if params.structured_outputs is not None:
            req.grammar = self.grammars.compile(params.structured_outputs)  # ParamError naming the field
        if params.use_beam_search:
            # the next beams are chosen from all beams' logits at once: a gang, never preempted
            req.beam = self._beam_search(len(prompt_token_ids), params)
            req.gang = True
            req.pinned_blocks = worst_case_blocks(len(prompt_token_ids), req.beam.max_new_tokens, params.num_beams,
                                                  self.block_size)
        seq = self._new_sequence(req, 0, list(prompt_token_ids))
        seq.pending_forks = params.num_samples - 1
        req.seqs.append(seq)
        self.scheduler.add(seq)  # registered last: an exception before leaves nothing behind
        self.requests[request_id] = req
        self.counters.prompt_tokens += len(prompt_token_ids)
        self._idle_checked = False

    def _beam_search(self, prompt_len: int, p: SamplingParams) -> BeamSearch:
        max_new = self.max_new_tokens(prompt_len, p)
        return BeamSearch(num_beams=p.num_beams, length_penalty=p.length_penalty, early_stopping=p.early_stopping,
                          max_new_tokens=max_new, finish_token_ids=self.finish_token_ids(p), min_tokens=p.min_tokens,
                          logprobs=p.logprobs)

    def _new_sequence(self, req: Request, index: int, token_ids: list[int], logprobs: list | None = None) -> Sequence:
        return Sequence(next(self._seq_ids), req, index, token_ids, self.cache,
                        logprobs=[] if logprobs is None else logprobs,
                        matcher=None if req.grammar is None else self.grammars.matcher(req.grammar))

    def max_new_tokens(self, prompt_len: int, p: SamplingParams) -> int:
        return self.limits.max_new_tokens(prompt_len, p)

    def finish_token_ids(self, p: SamplingParams) -> set[int]:
        return self.limits.finish_token_ids(p)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        req.aborted = True
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self._news[request_id] = req

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._news) or self._pending is not None

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step; outputs of the requests that had news. Raises only what the engine cannot
        go on after (a device-level error, a broken cache invariant): see the NOTE above."""
        failures = self.counters.requests_failed
        try:
            out = self.scheduler.schedule()
            self.runner.release_rows(out.freed_seq_ids)
            scheduled = out.scheduled
        except Exception as exc:
            self._fail_unfinished(exc)
            scheduled = None
        launched = None
        with torch.inference_mode():
            if self.async_scheduling or self._pending is not None:  # (turned off with a step in flight)
                launched = self._step_overlapped(scheduled or [])
            elif scheduled:
                self._run(scheduled, self.cache.take_copy_ops())
        outputs = self._outputs()
        if launched is not None:
            self._pending = launched
            for seq in launched.samples:  # after the outputs, which never show a pending token
                if seq.status is Status.RUNNING:
                    seq.token_ids.append(PENDING_TOKEN)
        if self.counters.requests_failed != failures:
            self._check_cache()
        if not self.scheduler.has_unfinished() and self._pending is None and not self._idle_checked:
            self._idle_checked = True
            if self.config.check_invariants:
                self.cache.check_invariants()
        return outputs

    def _run(self, scheduled: list[tuple[Sequence, int]], copy_ops: list[tuple[int, int]]) -> None:
        try:
            results = [self._compute(scheduled, copy_ops)]
        except Exception as exc:
            results = self._isolate(scheduled, copy_ops, exc)
        self.counters.steps += 1
        for result in results:
            self._apply(result)

    def _step_overlapped(self, scheduled: list[tuple[Sequence, int]]) -> StepResult | None:
        """Launch this step, then settle the last one while it runs (see the NOTE above);
        returns the launched step, or None when it ran synchronously."""
        pending, self._pending = self._pending, None
        copy_ops = self.cache.take_copy_ops() if scheduled else []
        launched = None
        if scheduled and self.async_scheduling and \
                all(not s.request.gang and s.matcher is None and not Sampler.needs_token_values(s)
                    for s, _ in scheduled):
            feed = None if pending is None or pending.drawn is None else \
                (pending.drawn.tokens, pending.feed_rows(s for s, _ in scheduled))
            try:
                launched = self._compute(scheduled, copy_ops, feed)
                if launched.drawn is not None:
                    launched.drawn.start_copy()
                self.counters.steps += 1
            except Exception as exc:
                if is_device_error(exc):
                    raise
                self._draws.rewind()  # computed again below, synchronously, where faults are isolated
                launched = None
        if pending is not None:
            self._settle(pending)
        if launched is not None:
            self._apply_known(launched)
        elif scheduled:
            live = [(s, n) for s, n in scheduled if s.status is Status.RUNNING]  # not finished when settled
            if live:
                self._run(live, copy_ops)
        return launched

    def _settle(self, result: StepResult) -> None:
        """A launched step's drawn tokens reach the host: each replaces its sequence's pending
        token; a sequence that finished meanwhile drops it (never emitted)."""
        out = result.drawn.output() if result.drawn is not None else None
        for i, seq in enumerate(result.samples):
            if seq.token_ids[-1] != PENDING_TOKEN:
                continue  # finished before its pending token was appended
            seq.token_ids.pop()
            if seq.is_finished:
                continue
            try:
                self._append(seq, out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
            except Exception as exc:
                self._fail(seq.request, exc)

    # ---- compute: forward and sampling, no effect on requests, scheduler or cache ------
    def _compute(self, scheduled: list[tuple[Sequence, int]], copy_ops: list[tuple[int, int]],
                 feed=None) -> StepResult:
        self._draws.checkpoint()
        if feed is None:  # (the synchronous loop's call, which profilers and tests wrap)
            batch, logits = self.runner.execute(scheduled, self.cache.block_table, copy_ops)
        else:
            batch, logits = self.runner.execute(scheduled, self.cache.block_table, copy_ops, feed)
        result = StepResult(scheduled, len(batch.input_ids))
        if logits is not None:
            self._sample(batch.sample_seqs, logits, result)
        return result

    def _sample(self, sample_seqs: list[Sequence], logits: torch.Tensor, result: StepResult) -> None:
        rows, seqs, beam_rows = [], [], {}
        for j, seq in enumerate(sample_seqs):
            req = seq.request
            if req.beam is not None:
                beam_rows.setdefault(id(req), (req, {}))[1][seq.seq_id] = j
                continue
            rows.append(j)
            seqs.append(seq)
            # n > 1: the other samples start from this prompt's logits; forked when applied
            for index in range(len(req.seqs), len(req.seqs) + seq.pending_forks):
                child = self._new_sequence(req, index, list(seq.token_ids))
                result.forks.append((seq, child))
                rows.append(j)
                seqs.append(child)
        if seqs:
            result.samples = seqs
            result.drawn = self.sampler(logits if len(rows) == logits.shape[0] else
                                        logits[torch.tensor(rows, device=logits.device)], seqs)
        for req, row_of in beam_rows.values():
            # the scheduler runs all beams of a request in the same step
            rows = [row_of[s.seq_id] for s in req.seqs]
            result.beams.append((req, logits[torch.tensor(rows, device=logits.device)].float().log_softmax(-1)))

    def _isolate(self, scheduled: list[tuple[Sequence, int]], copy_ops: list[tuple[int, int]],
                 exc: Exception) -> list[StepResult]:
        """The step's compute raised: compute it again in halves to find the requests at fault."""
        if is_device_error(exc):
            raise exc
        self._draws.rewind()
        by_request: dict[int, list[tuple[Sequence, int]]] = {}
        for item in scheduled:  # a request's beams and samples stay together
            by_request.setdefault(id(item[0].request), []).append(item)
        groups = list(by_request.values())
        if len(groups) == 1:
            self._fail(scheduled[0][0].request, exc)
            return []
        logger.warning("a step of %d requests failed; computing it again in halves to find the ones at fault",
                       len(groups), exc_info=exc)
        return self._halves(groups, copy_ops)

    def _halves(self, groups: list[list[tuple[Sequence, int]]], copy_ops) -> list[StepResult]:
        mid = len(groups) // 2
        return self._attempt(groups[:mid], copy_ops) + self._attempt(groups[mid:], copy_ops)

    def _attempt(self, groups: list[list[tuple[Sequence, int]]], copy_ops) -> list[StepResult]:
        scheduled = [item for group in groups for item in group]
        try:
            return [self._compute(scheduled, self._copies_into(scheduled, copy_ops))]
        except Exception as exc:
            if is_device_error(exc):
                raise
            self._draws.rewind()
            if len(groups) == 1:
                self._fail(scheduled[0][0].request, exc)
                return []
            return self._halves(groups, copy_ops)

    def _copies_into(self, scheduled: list[tuple[Sequence, int]], copy_ops: list[tuple[int, int]]):
        """The step's copy-on-write copies into blocks of `scheduled`. Running one again before
        its sequence writes the block again is harmless; running it for a sequence not in the
        forward would overwrite what an earlier attempt wrote there."""
        if not copy_ops:
            return copy_ops
        table = self.cache.block_table
        blocks = {b for s, _ in scheduled for b in table(s.seq_id)}
        return [op for op in copy_ops if op[1] in blocks]

    # ---- apply: what was computed changes the requests, one request at a time ----------
    def _apply(self, result: StepResult) -> None:
        self._apply_known(result)
        running = Status.RUNNING
        if result.drawn is not None:
            out = result.drawn.output()
            for i, seq in enumerate(result.samples):
                if seq.status is not running:
                    continue
                try:
                    self._append(seq, out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
                except Exception as exc:
                    self._fail(seq.request, exc)
        for req, logprobs in result.beams:
            if req.seqs[0].status is not running:
                continue
            try:
                self._beam_step(req, logprobs)
            except Exception as exc:
                self._fail(req, exc)

    def _apply_known(self, result: StepResult) -> None:
        """What a step changes before its tokens are known: the commit and the forks."""
        self._commit(result.scheduled, result.num_tokens)
        for parent, child in result.forks:
            if parent.status is not Status.RUNNING:  # its request failed in this step
                continue
            try:
                parent.request.seqs.append(child)
                self.scheduler.fork(parent, child)
            except Exception as exc:
                self._fail(parent.request, exc)

    def _commit(self, scheduled: list[tuple[Sequence, int]], num_tokens: int) -> None:
        """The computed KV enters the cache; what each request held this step is recorded."""
        prompt_computed, multi, B = 0, {}, self.block_size
        mark_computed, running = self.cache.mark_tokens_computed, Status.RUNNING
        for seq, n in scheduled:
            if seq.status is not running:  # its request failed in this step
                continue
            req = seq.request
            try:
                start = seq.num_computed_tokens
                end = start + n
                mark_computed(seq.seq_id, seq.token_ids[start:end])  # sampled tokens enter the cache here
                if start < len(req.prompt_token_ids):
                    k = min(end, len(req.prompt_token_ids)) - start
                    req.num_computed_prompt_tokens += k
                    prompt_computed += k
                if len(req.seqs) == 1:  # what this step held; inline: most requests have one sequence
                    req.sharing.add_alone(-(-end // B))
                else:
                    multi[id(req)] = req
            except Exception as exc:
                self._fail(req, exc)
        self.counters.computed_tokens += num_tokens
        self.counters.computed_prompt_tokens += prompt_computed
        for req in multi.values():
            try:
                req.record_blocks(self.cache, B)
            except Exception as exc:
                self._fail(req, exc)

    def _beam_step(self, req: Request, logprobs: torch.Tensor) -> None:
        self.counters.generation_tokens += len(req.seqs)
        if req.beam.advance(req, logprobs, self._group_ops):
            self._news[req.request_id] = req

    def _append(self, seq: Sequence, token: int, logprob: float, top: dict | None) -> None:
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if top is not None:
            seq.logprobs.append(top)
        self.counters.generation_tokens += 1
        self._news[seq.request.request_id] = seq.request
        p = seq.params
        reason = None
        if seq.matcher is not None and accept(seq, token):  # the grammar is complete
            reason = "stop"
        elif token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    # ---- outputs ----------------------------------------------------------------------
    def _outputs(self) -> list[RequestOutput]:
        outputs = []
        for req in list(self._news.values()):
            try:
                out = self._output(req)
            except Exception as exc:
                self._fail(req, exc)
                out = self._output(req)  # the failed request's output, from plain fields
            if out is not None:
                outputs.append(out)
        self._news.clear()
        self._failed.clear()
        return outputs

    def _output(self, req: Request) -> RequestOutput | None:
        finished = req.finished
        out = failed_output(req) if req.request_id in self._failed else request_output(req, finished)
        if finished:
            self.requests.pop(req.request_id, None)
            c = self.counters
            c.requests_finished += 1
            c.cached_prompt_tokens += req.num_cached_tokens or 0
            c.block_steps_held += req.sharing.block_steps_held
            c.block_steps_without_sharing += req.sharing.block_steps_without_sharing
        return out

    # ---- failures -----------------------------------------------------------------------
    def fail_request(self, request_id: str) -> None:
        """Fail a request from outside the step (say its output could not be delivered): like
        abort_request, but it ends with "error". Unknown or finished: no-op."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        self._fail(req, None)
        self._check_cache()

    def _fail(self, req: Request, exc: BaseException | None) -> None:
        """`req` cannot go on: each of its sequences still going finishes with "error" (blocks
        freed) and the request reports so in this step's outputs. A device-level error is no
        request's fault: raised again, for the caller to stop."""
        if is_device_error(exc):
            raise exc
        if req.request_id in self._failed:  # a second error of the same request in this step
            return
        logger.error("request %s failed; it ends with finish_reason 'error'", req.request_id, exc_info=exc)
        self.scheduler.discard(req, "error")
        self._failed.add(req.request_id)
        self._news[req.request_id] = req
        self.counters.requests_failed += 1

    def _fail_unfinished(self, exc: Exception) -> None:
        """schedule() raised: what it changed before cannot be tied to one request, so every
        unfinished request fails."""
        if is_device_error(exc):
            raise exc
        unfinished = [r for r in self.requests.values() if not r.finished]
        logger.error("scheduling failed; failing the %d unfinished requests", len(unfinished), exc_info=exc)
        for req in unfinished:
            self._fail(req, None)

    def _check_cache(self) -> None:
        """After a failure: the pool must still be consistent, or nothing can run on it."""
        try:
            self.cache.check_invariants()
        except AssertionError:
            logger.critical("the KV cache is inconsistent after a failed request; the engine cannot go on",
                            exc_info=True)
            raise

    # ---- introspection ----------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        s = self.scheduler
        return EngineMetrics(**asdict(self.counters), running=len(s.running), waiting=len(s.waiting),
                             preemptions=s.num_preemptions, beam_reserved_blocks=s.admission.reserved_blocks,
                             num_blocks=self.num_blocks, block_size=self.block_size,
                             max_model_len=self.max_model_len, cache=self.cache.stats())


class _GroupOps:
    """beam_search.GroupOps on the engine: new members are sequences of the request, forked
    and dropped through the scheduler."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def fork(self, parent: Sequence, index: int) -> Sequence:
        child = self.engine._new_sequence(parent.request, index, list(parent.token_ids), list(parent.logprobs))
        self.engine.scheduler.fork(parent, child)
        return child

    def drop(self, seq: Sequence) -> None:
        self.engine.scheduler.drop(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.engine.scheduler.finish(seq, reason)
