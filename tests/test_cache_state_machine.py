"""Random add / append / reserve / compute / fork / free / evict / reset sequences against
the cache manager (plus engine-like combinations of them, and the races around pending
copy ops), with a simulated KV memory and a reference model of which prefixes must hit.

- KV memory: every slot holds what was written into it: (namespace, token prefix). Copy ops
  are taken and applied before each write, as a model runner would. After every step
  every computed token of every live sequence must be found in its block table: this
  catches a wrong hit, a lost copy-on-write, a write into a shared or cached block, and an
  evicted or recycled block that was still held.
- Hits: a prompt must hit at least the longest block-aligned prefix some live sequence of
  its namespace has computed (those blocks cannot be evicted), at most the longest one
  ever committed in that namespace since the last reset, exactly that while nothing was
  evicted, and never more than (len - 1) // B * B tokens.
- check_invariants() after every step; a failed reservation or admission changes nothing
  (counters, LRU order and namespaces included).
- Namespaces come and go: one-shot tenants arrive, compute, leave; the manager holds a
  namespace exactly while it has a live sequence or a cached block, and a reset drops
  every namespace without a live sequence.
- Events: replaying every BlockStored / BlockRemoved (block ids and keys) gives exactly the
  blocks the tree holds, each under its key; the accessors (counts, ref counts, a
  sequence's tokens and block keys) agree with the manager's state.
"""

from array import array

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

from radixkv.cache import BlockRemoved, BlockStored, KVCacheManager, prompt_block_keys

B = 2
SALTS = (None, "tenant-a", b"tenant-b")  # b"pressure" is the eviction rule's own tenant
# A tiny vocabulary and a few shared stems make hits, splits and duplicate blocks common.
STEMS = ((), (1, 2, 3, 4), (1, 2, 3, 5, 6, 7), (2, 2, 2, 2, 2, 2, 2, 2))
tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=7)


class CacheMachine(RuleBasedStateMachine):
    hash_algo = "sha256"
    prefix_caching = True
    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(4, 24))
    def setup(self, num_blocks):
        self.m = KVCacheManager(num_blocks, B, hash_algo=self.hash_algo, enable_prefix_caching=self.prefix_caching,
                                enable_events=True)
        self.salt_of = {}  # namespace (salt bytes) -> the salt as given
        self.stored = {}  # block id -> key, replayed from the events
        self.N = num_blocks
        self.kv = [[None] * B for _ in range(num_blocks)]
        self.live = {}  # sid -> (tokens, ns)
        self.reserved = {}  # sid -> slots it may write: the reference of what reserve_slots granted
        self.committed = {}  # namespace -> block-aligned prefixes committed since the last reset
        self.next_id = 0
        self.evicted_at_reset = 0

    def _ns(self, salt):
        return salt if not isinstance(salt, str) else salt.encode()

    def _committed(self, ns):
        return self.committed.setdefault(ns, set())

    def _prefix_len(self, prompt, prefixes):
        cap = (len(prompt) - 1) // B
        k = 0
        while k < cap and tuple(prompt[: (k + 1) * B]) in prefixes:
            k += 1
        return k * B

    @rule(target=seqs, stem=st.sampled_from(STEMS), tail=tokens_st, salt=st.sampled_from(SALTS))
    def add(self, stem, tail, salt):
        prompt = list(stem) + tail
        sid = self.next_id
        self.next_id += 1
        if not prompt:
            try:
                self.m.add_sequence(sid, prompt, salt=salt)
            except ValueError:
                return consumes_nothing()
            raise AssertionError("empty prompt accepted")
        ns = self._ns(salt)
        peek = self.m.peek_prefix(prompt, salt=salt)
        before = self.m.stats()
        hit = self.m.add_sequence(sid, prompt, salt=salt)
        assert hit == peek and hit % B == 0 and hit <= (len(prompt) - 1) // B * B
        after = self.m.stats()
        assert after.free_blocks == before.free_blocks, "a lookup took a free block"
        assert after.prefix_query_tokens - before.prefix_query_tokens == len(prompt)
        assert after.prefix_hit_tokens - before.prefix_hit_tokens == hit
        if self.prefix_caching:
            lower = max([self._common(prompt, s) for s in self._live_computed(ns)] + [0])
            upper = self._prefix_len(prompt, self._committed(ns))
            assert lower <= hit <= upper, (lower, hit, upper)
            if self.m.stats().evicted_blocks == self.evicted_at_reset:
                assert hit == upper
        else:
            assert hit == 0
        self.live[sid] = (prompt, ns)
        self.salt_of[ns] = salt
        self.reserved[sid] = hit
        return sid

    @rule(target=seqs, stem=st.sampled_from(STEMS), tail=tokens_st, salt=st.sampled_from(SALTS),
          ahead=st.integers(0, 3))
    def try_admit(self, stem, tail, salt, ahead):
        """Exact admission: the shortfall said beforehand decides; a refusal changes nothing."""
        prompt = list(stem) + tail
        if not prompt:
            return consumes_nothing()
        sid = self.next_id
        self.next_id += 1
        peek = self.m.peek_prefix(prompt, salt=salt)
        short = self.m.blocks_short_to_admit(prompt, salt=salt, num_lookahead_tokens=ahead)
        snap = self._snapshot()
        ok = self.m.try_admit(sid, prompt, salt=salt, num_lookahead_tokens=ahead)
        assert ok == (short == 0), (ok, short)
        if not ok:
            assert self._snapshot() == snap, "a refused admission changed something"
            assert sid not in self.m
            return consumes_nothing()
        ns = self._ns(salt)
        hit = self.m.num_computed_tokens(sid)
        assert hit == peek
        self.live[sid] = (prompt, ns)
        self.salt_of[ns] = salt
        self.reserved[sid] = len(prompt) + ahead
        assert len(self.m.block_table(sid)) * B >= len(prompt) + ahead
        self.compute(sid, len(prompt) - hit)
        return sid

    @rule(length=st.integers(1, 5), keep=st.booleans())
    def one_shot_tenant(self, length, keep):
        """A tenant seen once: a fresh salt computes a short prompt and (mostly) leaves. Its
        namespace stays only while it has cached blocks, so the count stays bounded."""
        salt = f"one-shot-{self.next_id}"
        sid = self.add(STEMS[0], [1] * length, salt)
        self.prefill(sid)
        if not keep:
            self.free(sid)

    @rule(target=seqs, stem=st.sampled_from(STEMS[1:]), tail=tokens_st, salt=st.sampled_from(SALTS))
    def admit(self, stem, tail, salt):
        """Engine-like: add a prompt and compute it at once (when the pool allows)."""
        sid = self.add(stem, tail, salt)
        self.prefill(sid)
        return sid

    @rule(target=seqs, parent=seqs, tok=st.integers(0, 3))
    def sample(self, parent, tok):
        """Engine-like parallel sampling: fork, then the child decodes its own token."""
        child = self.fork(parent)
        if child in self.live:
            self.decode(child, tok)
        return child

    @rule(target=seqs, parent=consumes(seqs), tok=st.integers(0, 3))
    def preempt_after_fork(self, parent, tok):
        """The child reserves (copy op pending), then the parent is freed before the ops are
        taken: the copy source must not be handed out again until they are."""
        child = self.fork(parent)
        if child not in self.live:
            return child
        self.append(child, [tok])
        self.reserve(child, 1)
        self.free(parent)
        other = self.add(STEMS[3], [tok], None)  # competes for blocks before the copy runs
        self.reserve(other, 3)
        self.compute(child, 1)
        self.free(other)
        return child

    @rule(target=seqs, parent=seqs, tok=st.integers(0, 3), ahead=st.integers(1, 3))
    def fork_after_reserve(self, parent, tok, ahead):
        """The parent reserved slots in its partial block before the fork, then writes them
        in place (maybe filling and committing the block the child still shares)."""
        if parent not in self.live or self.m.num_computed_tokens(parent) != len(self.live[parent][0]):
            return consumes_nothing()
        if self._reserve(parent, ahead):  # lookahead: slots before the tokens are known
            return consumes_nothing()
        child = self.fork(parent)
        self.append(parent, [tok] * ahead)
        self.compute(parent, ahead)
        return child

    @rule(target=seqs, parent=consumes(seqs), tok=st.integers(0, 3), ahead=st.integers(1, 3))
    def fork_after_reserve_then_finish(self, parent, tok, ahead):
        """As above, then the parent finishes: the child alone holds a block the parent
        committed, outside its own chain, until it copies away from it or is freed."""
        child = self.fork_after_reserve(parent, tok, ahead)
        self.free(parent)
        return child

    @rule(target=seqs, beams=st.lists(seqs, min_size=1, max_size=3, unique=True),
          picks=st.lists(st.integers(0, 2), min_size=1, max_size=4),
          toks=st.lists(st.integers(0, 3), min_size=4, max_size=4), reuse=st.booleans(), free_late=st.booleans())
    def beam_step(self, beams, picks, toks, reuse, free_late):
        """Engine-like beam search step: every new beam forks a chosen parent (a parent may be
        chosen several times, or not at all) and the old beams are freed, then the new beams
        decode. With `reuse`, a parent's first pick continues in the parent itself, as the
        engine does; with `free_late`, the new beams reserve (copy ops pending on the shared
        partial blocks) before the old beams are freed."""
        for b in beams:
            if b in self.live:
                self.prefill(b)
        beams = [b for b in beams if b in self.live and self.m.num_computed_tokens(b) == len(self.live[b][0])]
        if not beams:
            return consumes_nothing()
        children, kept = [], set()
        for i in picks:
            parent = beams[i % len(beams)]
            if reuse and parent not in kept:
                kept.add(parent)
                children.append(parent)
            else:
                children.append(self.fork(parent))
        reserved = []
        for child, tok in zip(children, toks):
            if free_late:
                self.append(child, [tok])
                if self._reserve(child, 1) == 0:
                    reserved.append(child)
        for b in beams:
            if b not in kept:
                self.free(b)
        for child, tok in zip(children, toks):
            if not free_late:
                self.decode(child, tok)
            elif child in reserved:
                self.compute(child, 1)
        new = [c for c in children if c not in kept]
        return multiple(*new) if new else consumes_nothing()

    @rule(extra=st.integers(1, 4))
    def evict(self, extra):
        """Memory pressure: a newcomer reserves every free block and `extra` more, so that
        cached blocks are evicted (the manager evicts only inside reservations)."""
        before = self.m.stats()
        sid = self.add(STEMS[0], [3], b"pressure")
        want = min(before.free_blocks + extra, self.m.num_available_blocks)
        if self._reserve(sid, want * B) == 0 and self.prefix_caching:
            assert self.m.stats().evicted_blocks - before.evicted_blocks == want - before.free_blocks
        self.free(sid)

    @rule(parent=seqs, tok=st.integers(0, 3))
    def abort_after_reserve(self, parent, tok):
        """A child reserves (copy op pending) and is aborted before the ops are taken."""
        child = self.fork(parent)
        if child not in self.live:
            return
        self.append(child, [tok])
        self.reserve(child, 2)
        self.free(child)

    def _live_computed(self, ns):
        for sid, (toks, ns2) in self.live.items():
            if ns2 == ns:
                yield toks[: self.m.num_computed_tokens(sid) // B * B]

    def _common(self, prompt, done):
        cap = (len(prompt) - 1) // B * B
        k = 0
        while k + B <= min(cap, len(done)) and prompt[k : k + B] == done[k : k + B]:
            k += B
        return k

    @rule(sid=seqs, new=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def append(self, sid, new):
        if sid not in self.live:
            return
        self.m.append_tokens(sid, new)
        self.live[sid][0].extend(new)

    @rule(sid=seqs, n=st.integers(0, 6))
    def reserve(self, sid, n):
        if sid in self.live:
            self._reserve(sid, n)

    def _reserve(self, sid, n):
        needed = self.m.num_blocks_needed(sid, n)
        available = self.m.num_available_blocks
        missing = self.m.blocks_short(sid, n)
        assert missing == max(0, needed - available)
        snap = self._snapshot()
        ok = self.m.try_reserve(sid, n)
        assert ok is (missing == 0)
        if not ok:
            assert self._snapshot() == snap, "a failed reservation changed something"
        else:
            done = self.m.num_computed_tokens(sid)
            assert len(self.m.block_table(sid)) * B >= done + n
            self.reserved[sid] = max(self.reserved[sid], done + n)
        return missing

    @rule(sid=seqs, n=st.integers(1, 6))
    def compute(self, sid, n):
        if sid not in self.live:
            return
        toks, ns = self.live[sid]
        done = self.m.num_computed_tokens(sid)
        if done + n > self.reserved[sid]:  # never granted: must be refused, changing nothing
            snap = self._snapshot()
            try:
                self.m.mark_tokens_computed(sid, (toks + [0] * n)[done : done + n])
            except ValueError:
                assert self._snapshot() == snap
            else:
                raise AssertionError("mark_tokens_computed accepted slots that were never reserved")
        n = min(n, len(toks) - done, self.reserved[sid] - done)
        if n <= 0:
            return
        wrong = toks[done : done + n]
        wrong[-1] += 1  # a token that is not the known one: refused, nothing applied
        snap = self._snapshot()
        try:
            self.m.mark_tokens_computed(sid, wrong)
        except ValueError:
            assert self._snapshot() == snap
        else:
            raise AssertionError("mark_tokens_computed accepted a token it does not know")
        self._run_copies()
        table = self.m.block_table(sid)
        for i in range(done, done + n):
            self.kv[table[i // B]][i % B] = (ns, tuple(toks[: i + 1]))
        self.m.mark_tokens_computed(sid, toks[done : done + n])
        if self.prefix_caching:
            for k in range(1, (done + n) // B + 1):
                self._committed(ns).add(tuple(toks[: k * B]))

    @rule(sid=seqs)
    def prefill(self, sid):
        """Engine-like: reserve every known token not computed yet, then compute them."""
        if sid not in self.live:
            return
        n = len(self.live[sid][0]) - self.m.num_computed_tokens(sid)
        if n and self._reserve(sid, n) == 0:
            self.compute(sid, n)

    @rule(sid=seqs, tok=st.integers(0, 3), appended=st.booleans())
    def decode(self, sid, tok, appended=True):
        """Engine-like: one sampled token, reserved and computed (when all before it are);
        either appended first, or given to mark_tokens_computed only (appended by it)."""
        if sid not in self.live or self.m.num_computed_tokens(sid) != len(self.live[sid][0]):
            return
        if appended:
            self.append(sid, [tok])
            if self._reserve(sid, 1) == 0:
                self.compute(sid, 1)
        elif self._reserve(sid, 1) == 0:
            self._run_copies()
            toks, ns = self.live[sid]
            done = len(toks)
            self.kv[self.m.block_table(sid)[done // B]][done % B] = (ns, tuple(toks + [tok]))
            self.m.mark_tokens_computed(sid, [tok])
            toks.append(tok)
            if self.prefix_caching and (done + 1) % B == 0:
                self._committed(ns).add(tuple(toks))

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent not in self.live:
            return consumes_nothing()
        child = self.next_id
        self.next_id += 1
        before = self.m.stats()
        self.m.fork(parent, child)
        after = self.m.stats()
        assert (after.prefix_query_tokens, after.prefix_hit_tokens) == (before.prefix_query_tokens, before.prefix_hit_tokens)
        toks, ns = self.live[parent]
        self.live[child] = (list(toks), ns)
        self.reserved[child] = self.m.num_computed_tokens(parent)  # a reservation is not inherited
        return child

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid not in self.live:
            return
        self.m.free(sid)
        del self.live[sid]
        try:
            self.m.free(sid)
        except KeyError:
            pass
        else:
            raise AssertionError("double free accepted")

    @rule()
    def reset(self):
        snap = self._snapshot()
        referenced = any(self.m.block_table(s) for s in self.live)
        ok = self.m.reset_prefix_cache()
        assert ok == (not referenced)
        if ok:
            assert self.m.stats().cached_blocks == 0
            self.committed = {}
            self.evicted_at_reset = self.m.stats().evicted_blocks
            assert self.m.num_namespaces == len({ns for _, ns in self.live.values()})
        else:
            assert self._snapshot() == snap

    @rule()
    def run_copies(self):
        self._run_copies()

    def _run_copies(self):
        ops = self.m.take_copy_ops()
        srcs, dsts = {s for s, _ in ops}, [d for _, d in ops]
        assert len(set(dsts)) == len(dsts) and not srcs & set(dsts), ops
        data = {s: list(self.kv[s]) for s in srcs}  # all ops read before any writes (one launch)
        for s, d in ops:
            self.kv[d] = list(data[s])

    def _snapshot(self):
        s = self.m.stats()
        lru = [key[:2] for key in self.m.tree.lru._order]  # (last use, node): the eviction order
        return (s, {sid: self.m.block_table(sid) for sid in self.live}, self.m.num_free_blocks, lru,
                sorted(map(repr, self.m.tree.namespaces)))

    @invariant()
    def consistent(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        s = self.m.stats()
        assert s.free_blocks + s.evictable_blocks + s.in_use_blocks == self.N

    @invariant()
    def namespaces_held(self):
        """Held: every namespace with a live sequence; at most those plus the ones that
        committed a block since the last reset (eviction may have emptied some)."""
        if not hasattr(self, "m"):
            return
        live = {ns for _, ns in self.live.values()}
        held = {key[0] for key in self.m.tree.namespaces}
        assert live <= held <= live | {ns for ns, c in self.committed.items() if c}, (live, held)
        assert self.m.num_namespaces == len(self.m.tree.namespaces) == self.m.stats().num_namespaces

    @invariant()
    def events_replay_to_the_tree(self):
        if not hasattr(self, "m"):
            return
        for e in self.m.take_events():
            assert len(e.block_ids) == len(e.block_keys)
            if isinstance(e, BlockStored):
                for b, k in zip(e.block_ids, e.block_keys):
                    assert b not in self.stored, f"block {b} stored twice"
                    self.stored[b] = k
            else:
                assert isinstance(e, BlockRemoved)
                for b, k in zip(e.block_ids, e.block_keys):
                    assert self.stored.pop(b) == k, f"block {b} removed under another key"
        node_of = self.m.tree.node_of
        assert set(self.stored) == {b for b in range(self.N) if node_of[b] is not None}
        for b, k in self.stored.items():
            node = node_of[b]
            assert node.keys[node.blocks.index(b)] == k

    @invariant()
    def accessors(self):
        if not hasattr(self, "m"):
            return
        m = self.m
        assert m.num_free_blocks + m.num_evictable_blocks + m.num_in_use_blocks == self.N == m.num_blocks
        assert m.num_cached_blocks == m.stats().cached_blocks and m.num_sequences == len(self.live)
        held = [0] * self.N
        for sid, (toks, ns) in self.live.items():
            assert m.token_ids(sid) == toks
            table = m.block_table(sid)
            for b in table:
                held[b] += 1
            keys = m.block_keys(sid)
            committed = m.num_computed_tokens(sid) // B if self.prefix_caching else 0
            assert keys == prompt_block_keys(toks[: committed * B], B, salt=self.salt_of[ns],
                                             hash_algo=self.hash_algo)
            assert all(m.is_cached(b) for b in table[:committed])
        assert [m.ref_count(b) for b in range(self.N)] == held

    @invariant()
    def kv_contents(self):
        if not hasattr(self, "m"):
            return
        copies = dict(self.m.pool._copy_src)  # pending ops, dst -> src
        for sid, (toks, ns) in self.live.items():
            table = self.m.block_table(sid)
            for i in range(self.m.num_computed_tokens(sid)):
                b = table[i // B]
                b = copies.get(b, b)  # a pending copy's destination will hold its source's bytes
                assert self.kv[b][i % B] == (ns, tuple(toks[: i + 1])), f"seq {sid} token {i} block {b}"

    @invariant()
    def cached_contents(self):
        """Every block in the tree holds the KV of the tokens it is filed under."""
        if not hasattr(self, "m"):
            return
        for ns_obj in self.m.tree.namespaces.values():
            ns = ns_obj.salt
            stack = [(ns_obj.root, ())]
            while stack:
                node, prefix = stack.pop()
                for child in node.children.values():
                    toks = array("I")
                    toks.frombytes(child.tokens)
                    full = prefix + tuple(toks)
                    for j, b in enumerate(child.blocks):
                        start = len(prefix) + j * B
                        for i in range(B):
                            assert self.kv[b][i] == (ns, full[: start + i + 1]), f"cached block {b} slot {i}"
                    stack.append((child, full))


def consumes_nothing():
    return multiple()  # a rule with a target that produced no sequence


class XXHashMachine(CacheMachine):
    hash_algo = "xxh3_128"


class NoPrefixCachingMachine(CacheMachine):
    prefix_caching = False


_settings = settings(max_examples=400, stateful_step_count=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestCacheMachineSha256 = CacheMachine.TestCase
TestCacheMachineSha256.settings = _settings
TestCacheMachineXXH3 = XXHashMachine.TestCase
TestCacheMachineXXH3.settings = settings(_settings, max_examples=200)
TestCacheMachineNoPrefixCaching = NoPrefixCachingMachine.TestCase
TestCacheMachineNoPrefixCaching.settings = settings(_settings, max_examples=100)
