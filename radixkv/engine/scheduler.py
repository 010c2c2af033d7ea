"""Continuous batching over the radix cache.

Every step has a token budget. Running sequences come first, in admission order: each takes
what it still has to compute (1 token when decoding, a chunk of its prompt otherwise), so
prefill chunks and decodes share a step. When the pool has no block left for one of them,
the most recently admitted running sequence is preempted (its blocks freed, its tokens kept,
recomputed later; committed blocks usually come back as cache hits). Waiting sequences are
then admitted while the budget, the sequence limit and the pool allow, preempted ones first.
With prefix caching, a waiting prompt whose first block a running sequence is still computing
waits for that computation (then hits the cache) rather than computing the same blocks twice.

Sequence groups (sequence.py): the live sequences of a gang request are scheduled together
(all or none in a step); a pinned request is never preempted, and admitted only while the
worst cases of all admitted pinned requests fit the pool together (admission.py); a pinned
sequence that cannot grow preempts sequences of other requests, which always free enough.
Beam search is the one user of both; the scheduler knows nothing else of it.

Decode fast path: a step where every running sequence decodes one token, none belongs to a
gang and none waits asks the cache for a reservation only where one can change something: a
token that starts a new block, or the first token after a start or a fork (whose partial
block may need copy-on-write). Such a reservation runs to the end of the token's block
(`_reserved_to`): it takes the same blocks and copies as one token would, and the tokens
after it in that block need no call. A fork or free forgets the sequence's entry. The blocks
taken, in order, and any preemption are those of the general loop, which handles all else.

No deadlock: a sequence alone always fits, because the engine rejects up front any request
whose prompt + max_tokens exceeds the pool, and a sequence that cannot grow preempts others
before itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from radixkv.engine.admission import PinnedAdmission
from radixkv.engine.sequence import Sequence, Status

WINDOW = 64  # waiting sequences looked at per step (beyond those skipped)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    # sequences whose cache records were freed since the last schedule() (finished, dropped,
    # failed, preempted): whoever mirrors per-sequence state (the runner's block tables) drops it
    freed_seq_ids: list[int] = field(default_factory=list)


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
        self.admission = PinnedAdmission(cache.num_blocks if num_blocks is None else num_blocks)
        self._freed: list[int] = []  # seq ids freed since the last schedule()
        # seq id -> end of its slots reserved through a block's end by the decode fast path,
        # no fork since; those before it need no reservation call
        self._reserved_to: dict[int, int] = {}

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
        if seq.request.pinned_blocks and all(s.is_finished for s in seq.request.seqs):
            self.admission.release(seq.request)

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
        self.admission.release(request)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares all of parent's blocks: a sample once the prompt is computed (its seat
        held since admission), or a member of a pinned group (its worst case reserved)."""
        assert parent.status is Status.RUNNING and (parent.pending_forks > 0 or parent.request.pinned_blocks)
        self.cache.fork(parent.seq_id, child.seq_id)
        self._reserved_to.pop(parent.seq_id, None)  # its partial block is shared now: copy-on-write first
        if parent.pending_forks:
            parent.pending_forks -= 1
            self._pending_forks -= 1
        child.status = Status.RUNNING
        self.running.append(child)

    def drop(self, seq: Sequence) -> None:
        """A group member with no continuation (a beam not chosen): its blocks are released,
        shared ones stay with the others; the group goes on."""
        assert seq.status is Status.RUNNING and seq.request.gang
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED

    def _free(self, seq: Sequence) -> None:
        self.cache.free(seq.seq_id)
        self._freed.append(seq.seq_id)
        self._reserved_to.pop(seq.seq_id, None)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        assert not seq.request.pinned_blocks, "pinned groups are never preempted"
        for i, (s, n) in enumerate(out.scheduled):  # a victim scheduled earlier in this step
            if s is seq:
                del out.scheduled[i]
                out.num_batched_tokens -= n
                break
        out.preempted.append(seq)
        self.running.remove(seq)
        self._pending_forks -= seq.pending_forks
        self._free(seq)
        seq.status, seq.preempted = Status.WAITING, True  # its tokens stay, to be computed again
        self.waiting.appendleft(seq)  # victims leave latest-first, so earlier ones end up in front
        self.num_preemptions += 1

    # ---- the step -------------------------------------------------------------------
    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, budget, self.max_prefill_chunk)

    def schedule(self) -> SchedulerOutput:
        out = self._schedule_decodes() if not self.waiting else None
        if out is None:
            out = self._schedule_all()
        out.freed_seq_ids, self._freed = self._freed, []
        return out

    def _schedule_all(self) -> SchedulerOutput:
        """Running sequences first (chunks, decodes, gangs, preemption), then admissions."""
        out = SchedulerOutput()
        limit, chunk, reserve, running = self.max_num_batched_tokens, self.max_prefill_chunk, \
            self.cache.try_reserve, Status.RUNNING
        gangs_done = set()
        for seq in list(self.running):  # a copy: preemption removes from the list
            budget = limit - out.num_batched_tokens
            if budget <= 0:
                break
            if seq.status is not running:  # preempted earlier in this step
                continue
            if seq.request.gang:
                if id(seq.request) not in gangs_done:
                    gangs_done.add(id(seq.request))
                    self._schedule_gang(seq.request.seqs, budget, out)
                continue
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget, chunk)
            assert n > 0, "a running sequence has nothing to compute"
            if reserve(seq.seq_id, n) or self._reserve(seq, n, out):
                out.scheduled.append((seq, n))
                out.num_batched_tokens += n
        if not out.preempted:  # admitting right after a preemption would only thrash
            out.num_batched_tokens = limit - self._admit(out, limit - out.num_batched_tokens)
        return out

    def _schedule_decodes(self) -> SchedulerOutput | None:
        """The decode fast path (module docstring), or None: not every running sequence decodes
        one token outside a gang, or too many for the token budget. Nothing waits."""
        running = self.running
        if not running or len(running) > self.max_num_batched_tokens:
            return None
        computed, B, reserved_to = self.cache.num_computed_tokens, self.block_size, self._reserved_to
        to_reserve = []
        for seq in running:
            done = computed(seq.seq_id)
            if len(seq.token_ids) - done != 1 or seq.request.gang:
                return None
            if done >= reserved_to.get(seq.seq_id, 0):
                to_reserve.append((seq, done))
        out = SchedulerOutput()
        reserve, running_status = self.cache.try_reserve, Status.RUNNING
        for seq, done in to_reserve:  # in running order, as the general loop reserves
            if seq.status is not running_status:  # preempted for an earlier one
                continue
            n = B - done % B  # to the end of the block: the blocks and copies of one token
            if reserve(seq.seq_id, n) or self._reserve(seq, n, out):
                reserved_to[seq.seq_id] = done + n
        out.scheduled = [(seq, 1) for seq in self.running]  # preempted ones are gone from it
        out.num_batched_tokens = len(out.scheduled)
        return out

    def _schedule_gang(self, members: list[Sequence], budget: int, out: SchedulerOutput) -> None:
        """All live members of a gang request, or none (not enough budget: they wait a step)."""
        chunks = [self._chunk(s, budget) for s in members]
        if sum(chunks) > budget:
            return
        for s, n in zip(members, chunks):
            assert n > 0, "a gang member has nothing to compute"
            ok = self._reserve(s, n, out)
            assert ok
            out.scheduled.append((s, n))
            out.num_batched_tokens += n

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Reserve n slots, preempting the latest running unpinned sequences as needed; False if
        `seq` itself was preempted."""
        while not self.cache.try_reserve(seq.seq_id, n):
            victim = self._victim()
            assert victim is not None, "pinned groups outgrew their reservation"
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _victim(self) -> Sequence | None:
        if not self.admission.reserved_blocks:
            return self.running[-1] if self.running else None
        return next((s for s in reversed(self.running) if not s.request.pinned_blocks), None)

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        hits = self._lpm_hits() if self.policy == "lpm" else None
        if not self.waiting:
            return budget
        heads = self._prefilling_heads() if self.defer_shared_prefill else None
        skipped: set[int] = set()
        while budget > 0:
            idx = self._pick(hits, skipped)
            if idx is None:
                break
            seq = self.waiting[idx]
            if len(self.running) + self._pending_forks + 1 + seq.pending_forks > self.max_num_seqs:
                break
            if not self.admission.fits(seq.request):
                break  # admitted pinned groups could not all grow to their worst case
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
            seq.status, seq.preempted = Status.RUNNING, False  # its computed tokens: the hit
            self.running.append(seq)
            self._pending_forks += seq.pending_forks
            self.admission.admit(seq.request)
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
