"""Continuous batching over the radix cache.

Every step has a token budget. Running sequences come first, in admission order: each takes
what it still has to compute (1 token when decoding, a chunk of its prompt otherwise), so
prefill chunks and decodes share a step. When the pool has no block left for one of them,
the most recently admitted running sequence is preempted (its blocks freed, its tokens kept,
recomputed later; committed blocks usually come back as cache hits). Waiting sequences are
then admitted while the budget, the sequence limit and the pool allow, preempted ones first.
With prefix caching, a waiting prompt whose first block a running sequence is still computing
waits for that computation (then hits the cache) rather than computing the same blocks twice.

Beam search: the beams of a request are scheduled together (all or none in a step), since
the next beams are chosen from all their logits at once; they are never preempted. Instead,
a beam request is admitted only while the worst cases of all admitted beam requests fit the
pool together (the engine rejects one that cannot fit alone), and a beam that cannot grow
preempts sequences of other requests, which always free enough.

No deadlock: a sequence alone always fits, because the engine rejects up front any request
whose prompt + max_tokens exceeds the pool, and a sequence that cannot grow preempts others
before itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from radixkv.engine.sequence import Sequence, Status

WINDOW = 64  # waiting sequences looked at per step (beyond those skipped)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0


class Scheduler:
    def __init__(self, cache, *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk: int | None, policy: str = "fcfs", defer_shared_prefill: bool = False,
                 num_blocks: int | None = None):
        self.cache = cache
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.policy = policy
        self.defer_shared_prefill = defer_shared_prefill  # worth it only with prefix caching on
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._pending_forks = 0  # seats held for samples not forked yet
        self.num_blocks = cache.stats().num_blocks if num_blocks is None else num_blocks
        self.beam_blocks = 0  # worst cases of the admitted beam requests, summed
        self.on_free = None  # called with a sequence whose blocks were just freed

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.status is Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop a sequence (waiting or running) and release its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._pending_forks -= seq.pending_forks
            self._free(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason, seq.pending_forks = Status.FINISHED, reason, 0
        beam = seq.request.beam
        if beam is not None and beam.reserved_blocks and all(s.is_finished for s in seq.request.seqs):
            self.beam_blocks -= beam.reserved_blocks
            beam.reserved_blocks = 0

    def discard(self, request, reason: str) -> None:
        """Finish every sequence of a request the engine failed, wherever an exception left it:
        running, waiting, between the two with blocks held (admission cut short), or running
        but not yet in request.seqs (a beam step cut short). Only the failure path scans."""
        seqs = list(request.seqs)
        seqs += [s for s in self.running if s.request is request and s not in seqs]
        seqs += [s for s in self.waiting if s.request is request and s not in seqs]
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq in self.running:
                self.running.remove(seq)
                self._pending_forks -= seq.pending_forks
            elif seq in self.waiting:
                self.waiting.remove(seq)
            if seq.seq_id in self.cache:
                self._free(seq)
            seq.status, seq.finish_reason, seq.pending_forks = Status.FINISHED, reason, 0
        beam = request.beam
        if beam is not None and beam.reserved_blocks:
            self.beam_blocks -= beam.reserved_blocks
            beam.reserved_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares all of parent's blocks (a sample once the prompt is computed, or a beam)."""
        assert parent.status is Status.RUNNING and (parent.pending_forks > 0 or parent.request.beam is not None)
        self.cache.fork(parent.seq_id, child.seq_id)
        if parent.pending_forks:  # a seat held since admission
            parent.pending_forks -= 1
            self._pending_forks -= 1
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = Status.RUNNING
        self.running.append(child)

    def drop(self, seq: Sequence) -> None:
        """A beam with no continuation: its blocks are released (shared ones stay with the others)."""
        assert seq.status is Status.RUNNING and seq.request.beam is not None
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED

    def _free(self, seq: Sequence) -> None:
        self.cache.free(seq.seq_id)
        if self.on_free is not None:
            self.on_free(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        assert seq.request.beam is None, "beams are never preempted"
        for i, (s, n) in enumerate(out.scheduled):  # a victim scheduled earlier in this step
            if s is seq:
                del out.scheduled[i]
                out.num_batched_tokens -= n
                break
        out.preempted.append(seq)
        self.running.remove(seq)
        self._pending_forks -= seq.pending_forks
        self._free(seq)
        seq.status, seq.num_computed_tokens, seq.preempted = Status.WAITING, 0, True
        self.waiting.appendleft(seq)  # victims leave latest-first, so earlier ones end up in front
        self.num_preemptions += 1

    # ---- the step -------------------------------------------------------------------
    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, budget, self.max_prefill_chunk)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        limit, chunk, reserve, running = self.max_num_batched_tokens, self.max_prefill_chunk, \
            self.cache.try_reserve, Status.RUNNING
        beams_done = set()
        for seq in list(self.running):  # a copy: preemption removes from the list
            budget = limit - out.num_batched_tokens
            if budget <= 0:
                break
            if seq.status is not running:  # preempted earlier in this step
                continue
            if seq.request.beam is not None:
                if id(seq.request) not in beams_done:
                    beams_done.add(id(seq.request))
                    self._schedule_beams(seq.request.seqs, budget, out)
                continue
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget, chunk)
            assert n > 0, "a running sequence has nothing to compute"
            if reserve(seq.seq_id, n) or self._reserve(seq, n, out):
                out.scheduled.append((seq, n))
                out.num_batched_tokens += n
        if not out.preempted:  # admitting right after a preemption would only thrash
            out.num_batched_tokens = limit - self._admit(out, limit - out.num_batched_tokens)
        return out

    def _schedule_beams(self, beams: list[Sequence], budget: int, out: SchedulerOutput) -> None:
        """All live beams of a request, or none (not enough budget: they wait a step)."""
        chunks = [self._chunk(s, budget) for s in beams]
        if sum(chunks) > budget:
            return
        for s, n in zip(beams, chunks):
            assert n > 0, "a beam has nothing to compute"
            ok = self._reserve(s, n, out)
            assert ok
            out.scheduled.append((s, n))
            out.num_batched_tokens += n

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Reserve n slots, preempting the latest running non-beam sequences as needed; False if
        `seq` itself was preempted."""
        while not self.cache.try_reserve(seq.seq_id, n):
            victim = self._victim()
            assert victim is not None, "beam requests outgrew their reservation"
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _victim(self) -> Sequence | None:
        if not self.beam_blocks:
            return self.running[-1] if self.running else None
        return next((s for s in reversed(self.running) if s.request.beam is None), None)

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        hits = self._lpm_hits() if self.policy == "lpm" else None
        heads = self._prefilling_heads() if self.defer_shared_prefill else None
        skipped: set[int] = set()
        while budget > 0:
            idx = self._pick(hits, skipped)
            if idx is None:
                break
            seq = self.waiting[idx]
            if len(self.running) + self._pending_forks + 1 + seq.pending_forks > self.max_num_seqs:
                break
            beam = seq.request.beam
            if beam is not None and self.beam_blocks + beam.worst_blocks > self.num_blocks:
                break  # admitted beam requests could not all grow to their longest
            salt = seq.request.cache_salt
            if heads is not None and not seq.preempted and self._computing_its_blocks(seq, heads):
                # a running sequence is computing blocks this prompt shares: admitted a step
                # or two later, it finds them cached instead of computing them again
                skipped.add(id(seq))
                continue
            # cheap check before add_sequence, which pins blocks and counts a prefix query
            hit = self.cache.peek_prefix(seq.token_ids, salt=salt)
            n = min(seq.num_tokens - hit, budget, self.max_prefill_chunk)
            needed = -(-(hit + n) // self.block_size) - hit // self.block_size
            if needed > self.cache.num_available_blocks:
                break
            hit = self.cache.add_sequence(seq.seq_id, seq.token_ids, salt=salt)
            n = min(seq.num_tokens - hit, budget, self.max_prefill_chunk)
            if not self.cache.try_reserve(seq.seq_id, n):
                self.cache.free(seq.seq_id)
                break
            del self.waiting[idx]
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = hit
            seq.status, seq.num_computed_tokens, seq.preempted = Status.RUNNING, hit, False
            self.running.append(seq)
            self._pending_forks += seq.pending_forks
            if beam is not None:
                beam.reserved_blocks = beam.worst_blocks
                self.beam_blocks += beam.worst_blocks
            out.scheduled.append((seq, n))
            budget -= n
            if heads is not None:
                self._note_computing(heads, seq, hit)
        return budget

    def _note_computing(self, heads: dict, seq: Sequence, computed: int) -> None:
        """Record that `seq` computes full prompt blocks from token `computed` on (block aligned)."""
        B = self.block_size
        if (seq.num_tokens - 1) // B > computed // B:  # a full block still to compute
            key = (seq.request.cache_salt, tuple(seq.token_ids[:B]))
            heads.setdefault(key, []).append((seq.token_ids, computed // B * B))

    def _prefilling_heads(self) -> dict:
        """First-block key -> (tokens, first uncomputed block start) of running prompts with full
        blocks still to compute."""
        heads: dict = {}
        for s in self.running:
            self._note_computing(heads, s, s.num_computed_tokens)
        return heads

    def _computing_its_blocks(self, seq: Sequence, heads: dict) -> bool:
        B, toks = self.block_size, seq.token_ids
        for other, start in heads.get((seq.request.cache_salt, tuple(toks[:B])), ()):
            # sharing the first block R has not computed yet (both prompts go beyond it)
            if len(toks) > start + B and toks[start : start + B] == other[start : start + B]:
                return True
        return False

    def _lpm_hits(self) -> dict[int, int]:
        window = list(self.waiting)[:WINDOW]
        return {id(s): self.cache.peek_prefix(s.token_ids, salt=s.request.cache_salt) for s in window}

    def _pick(self, hits: dict[int, int] | None, skipped: set[int]) -> int | None:
        """Index in `waiting` of the next sequence to admit (None: none in the window)."""
        best, best_hit = None, -1
        for idx, seq in enumerate(self.waiting):
            if idx >= WINDOW + len(skipped):
                break
            if id(seq) in skipped:
                continue
            if hits is None or seq.preempted:
                return idx  # FCFS; preempted sequences always go first
            h = hits.get(id(seq), 0)
            if h > best_hit:
                best, best_hit = idx, h
        return best
