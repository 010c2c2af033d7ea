"""Engine: requests in, incremental token outputs out, one step at a time.

Each step: schedule (running first, then admissions; preemption when the pool is full), run
the COW copies and the forward, commit what was computed to the radix cache, fork the extra
samples of requests whose prompt just finished, sample, and check stop conditions. Beam
search requests skip the sampler: their beams' logits go to beam_search.py, whose choice the
engine applies with forks and frees (ref counts only).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict

import torch

from radixkv.engine.beam_search import BeamSearch, worst_case_blocks
from radixkv.engine.block_tables import BlockTables
from radixkv.engine.config import EngineConfig
from radixkv.engine.model_runner import ModelRunner
from radixkv.engine.outputs import CompletionOutput, RequestOutput, request_output
from radixkv.engine.sampler import Sampler
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.sequence import Request, Sequence
from radixkv.engine.validate import validate_request
from radixkv.models.config import load_model_config

__all__ = ["Engine", "EngineConfig", "RequestOutput", "CompletionOutput", "SamplingParams"]


class Engine:
    def __init__(self, config: EngineConfig):
        from radixkv.cache import KVCacheManager

        self.config = config
        self.model_config = load_model_config(config.model_dir)
        self.device = config.resolved_device()
        self.runner = ModelRunner(config, self.model_config, self.device)
        self.block_size, self.num_blocks = config.block_size, self.runner.num_blocks
        # a sequence can never outgrow the pool: cap the context there too
        self.max_model_len = min(self.runner.max_positions, self.num_blocks * self.block_size)
        self.cache = KVCacheManager(self.num_blocks, self.block_size, hash_algo=config.hash_algo,
                                    hash_seed=config.hash_seed, enable_prefix_caching=config.enable_prefix_caching,
                                    enable_events=config.enable_cache_events)
        self.scheduler = Scheduler(self.cache, block_size=self.block_size, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_prefill_chunk=config.max_prefill_chunk, policy=config.scheduling_policy,
                                   defer_shared_prefill=config.enable_prefix_caching, num_blocks=self.num_blocks)
        self.tables = BlockTables(config.max_num_seqs, -(-self.max_model_len // self.block_size), self.block_size)
        self.scheduler.on_free = lambda seq: self.tables.release(seq.seq_id)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.sampler = Sampler(self.device, self.model_config.eos_token_ids, config.seed)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._news: dict[str, Request] = {}  # requests with outputs to report (aborts, between steps)
        self._idle_checked = True
        # computed_prompt_tokens: prompt positions computed (a prompt shared by n samples counts once);
        # block_steps_*: finished requests' block accounting (RequestOutput), summed
        self.counters = dict(prompt_tokens=0, cached_prompt_tokens=0, generation_tokens=0, computed_tokens=0,
                             computed_prompt_tokens=0, steps=0, requests_finished=0, block_steps_held=0,
                             block_steps_without_sharing=0)

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        params = SamplingParams() if params is None else params
        validate_request(self, request_id, prompt_token_ids, params, cache_salt)
        req = Request(request_id, list(prompt_token_ids), params, next(self._arrivals), cache_salt)
        if params.use_beam_search:
            req.beam = self._beam_search(len(prompt_token_ids), params)
        seq = Sequence(next(self._seq_ids), req, 0, list(prompt_token_ids), pending_forks=params.num_samples - 1)
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        self._idle_checked = False

    def _beam_search(self, prompt_len: int, p: SamplingParams) -> BeamSearch:
        max_new = self.max_new_tokens(prompt_len, p)
        return BeamSearch(num_beams=p.num_beams, length_penalty=p.length_penalty, early_stopping=p.early_stopping,
                          max_new_tokens=max_new, finish_token_ids=self.finish_token_ids(p), min_tokens=p.min_tokens,
                          logprobs=p.logprobs,
                          worst_blocks=worst_case_blocks(prompt_len, max_new, p.num_beams, self.block_size))

    def max_new_tokens(self, prompt_len: int, p: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        return room if p.max_tokens is None else min(p.max_tokens, room)

    def finish_token_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))

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
        return self.scheduler.has_unfinished() or bool(self._news)

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.scheduled:
            with torch.inference_mode():
                self._run(sched.scheduled)
        outputs = [o for o in (self._output(r) for r in self._news.values()) if o is not None]
        self._news.clear()
        if not self.scheduler.has_unfinished() and not self._idle_checked:
            self._idle_checked = True
            if self.config.check_invariants:
                self.cache.check_invariants()
        return outputs

    def _run(self, scheduled: list[tuple[Sequence, int]]) -> None:
        table = self.cache.block_table
        rows = self.tables.sync([(s.seq_id, table(s.seq_id), s.num_computed_tokens) for s, _ in scheduled])
        batch, logits = self.runner.execute(scheduled, self.tables, rows, self.cache.take_copy_ops())
        self.counters["steps"] += 1
        prompt_computed, multi, B = 0, {}, self.block_size
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            self.cache.mark_computed(seq.seq_id, n)
            end = seq.num_computed_tokens = start + n
            req = seq.request
            if start < len(req.prompt_token_ids):
                k = min(end, len(req.prompt_token_ids)) - start
                req.num_computed_prompt_tokens += k
                prompt_computed += k
            if len(req.seqs) == 1:  # what this step held; inline: most requests have one sequence
                req.sharing.add_alone(-(-end // B))
            else:
                multi[id(req)] = req
        self.counters["computed_tokens"] += len(batch.input_ids)
        self.counters["computed_prompt_tokens"] += prompt_computed
        for req in multi.values():
            req.record_blocks(self.cache, B)
        if logits is not None:
            self._sample(batch.sample_seqs, logits)

    def _sample(self, sample_seqs: list[Sequence], logits: torch.Tensor) -> None:
        rows, seqs, beam_rows = [], [], {}
        for j, seq in enumerate(sample_seqs):
            req = seq.request
            if req.beam is not None:
                beam_rows.setdefault(id(req), (req, {}))[1][seq.seq_id] = j
                continue
            rows.append(j)
            seqs.append(seq)
            while seq.pending_forks:  # n > 1: the other samples start from this prompt's logits
                child = Sequence(next(self._seq_ids), req, len(req.seqs), list(seq.token_ids))
                req.seqs.append(child)
                self.scheduler.fork(seq, child)
                rows.append(j)
                seqs.append(child)
        if seqs:
            out = self.sampler(logits if len(rows) == logits.shape[0] else
                               logits[torch.tensor(rows, device=logits.device)], seqs)
            for i, seq in enumerate(seqs):
                self._append(seq, out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
        for req, row_of in beam_rows.values():
            # the scheduler runs all beams of a request in the same step
            rows = [row_of[s.seq_id] for s in req.seqs]
            self._beam_step(req, logits[torch.tensor(rows, device=logits.device)].float().log_softmax(-1))

    def _beam_step(self, req: Request, logprobs: torch.Tensor) -> None:
        beams = req.seqs
        step = req.beam.step(logprobs, beams)
        self.counters["generation_tokens"] += len(beams)
        if step.done:
            for s in beams:
                self.scheduler.finish(s, "stop")
            self._news[req.request_id] = req
            return
        # forks first (children share the parent's blocks), then the dropped beams release theirs
        continued, children = set(), []
        for parent_idx, token, entry in step.keep:
            parent = beams[parent_idx]
            if parent_idx in continued:
                child = Sequence(next(self._seq_ids), req, 0, list(parent.token_ids), logprobs=list(parent.logprobs))
                self.scheduler.fork(parent, child)
            else:
                continued.add(parent_idx)
                child = parent
            children.append((child, token, entry))
        for i, s in enumerate(beams):
            if i not in continued:
                self.scheduler.drop(s)
        req.seqs = [c for c, _, _ in children]
        for rank, ((child, token, entry), score) in enumerate(zip(children, req.beam.scores.tolist())):
            child.index = rank
            child.token_ids.append(token)
            child.cumulative_logprob = score
            if entry is not None:
                child.logprobs.append(entry)
            self.cache.append_tokens(child.seq_id, [token])

    def _append(self, seq: Sequence, token: int, logprob: float, top: dict | None) -> None:
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if top is not None:
            seq.logprobs.append(top)
        self.counters["generation_tokens"] += 1
        self._news[seq.request.request_id] = seq.request
        p = seq.params
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            self.cache.append_tokens(seq.seq_id, [token])
        else:
            self.scheduler.finish(seq, reason)

    # ---- outputs ----------------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput | None:
        finished = req.finished
        if finished:
            self.requests.pop(req.request_id, None)
            c = self.counters
            c["requests_finished"] += 1
            c["cached_prompt_tokens"] += req.num_cached_tokens or 0
            c["block_steps_held"] += req.sharing.block_steps_held
            c["block_steps_without_sharing"] += req.sharing.block_steps_without_sharing
        return request_output(req, finished)

    # ---- introspection ----------------------------------------------------------------
    def metrics(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "beam_reserved_blocks": self.scheduler.beam_blocks,
            **self.counters,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "cache": asdict(self.cache.stats()),
        }
