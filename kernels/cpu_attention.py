"""Paged attention for the CPU: the flattened mixed batch in a few batched torch calls per layer.

Same signature and semantics as kernels.reference.paged_attention_ref, which stays the oracle
it is tested against (tests/test_cpu_attention.py), plus an optional `plan`: the host side of
a step (which rows go together, what to gather, masks, the argument checks) is worked out once
per step by plan_attention and reused by every layer (AttentionMetadata.plan).

K/V are gathered by token rows of the flattened cache [slots x kv_heads, d] straight into the
layout the matmuls want ([rows, kv_heads, tokens, d], contiguous), one index_select each.

One layer:
  prefill chunk   its K/V gathered, one SDPA call: causal when the chunk starts its sequence,
                  else a [n, ctx] mask (the chunk also sees its cached prefix)
  decode rows     sorted by context and cut into groups of at most `group_tokens` padded
                  tokens; per group one gather, q K^T, softmax, P V as batched matmuls over
                  [rows x kv_heads] with each kv head's query heads as the matrix rows (GQA
                  without repeating K/V), the rows' padding masked
  shared prefix   decode rows whose tables start with the same physical blocks (a cached
                  system prompt) read them once: all their queries against the shared K/V in
                  one matmul per kv head, then each row's private rest as above, the two
                  softmax parts merged by their maxima and sums (cascade attention)

NOTE (the grouping): on a 2-core EPYC, 1 thread (`python -m benchmarks.cpu_attention`, ms per
step of 30 layers), one call for a whole decode batch padded to its longest row was the slowest
variant for ragged contexts (32 decodes of 100-1,500 tokens: 736 ms, one row per call 461 ms):
the batch's gathered K/V (tens of MB) goes out to DRAM and back, while one row's stays in L2.
Groups of up to 2,048 padded tokens keep that locality (420 ms) and batch short rows, where the
per-call overhead dominates (32 decodes of 20-100 tokens: 34 ms, one row per call 68 ms).

NOTE (shared prefixes): a decode row is memory-bound (3 query heads per kv head here), so 32
rows after a 704-token system prompt read it 32 times; read once, their 96 queries per kv head
make one matmul worth running (201 ms -> 84 ms per step in the benchmark above). A prefix is
read once only when that saves at least `min_shared_tokens` KV tokens per layer ((rows - 1) x
shared length): 2 rows sharing 512 tokens or 8 sharing 128 were slower with it, 4 sharing 512
or 16 sharing 128 faster. Prefill chunks keep the plain path: a step holds few of them.

NOTE (threads): a layer whose work is small (plan.work < ONE_THREAD_WORK: with 3 kv heads,
decodes of up to ~32 rows x 1,300 tokens) runs on one thread. Its ops take microseconds, and
each of them (bmm, softmax, reductions) opens an OpenMP region over the intra-op threads: on a
loaded 2-core machine, where the second thread's core is busy with other work, every region
waited for it, 4-5 ms per bmm or softmax in a profiled decode step. `radixkv bench cpu` at 2
threads there: one chat 26.0 s before this, 2.3 s after (HF generate 11.1 s and 10.4 s).

NOTE (the workspace): gathers go into one buffer per (device, dtype), grown when a step needs
more and then kept: a fresh tensor of tens of MB per call is mmapped and page-faulted by glibc
every time, which cost several times the gather itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kernels.checks import check_attention, check_store_kv

GROUP_TOKENS = 2048  # padded KV tokens per decode group (see the NOTE above)
MIN_SHARED_TOKENS = 1024  # KV tokens per layer a shared prefix must save to be read once
ONE_THREAD_WORK = 1 << 17  # a layer smaller than this (plan.work) runs on one thread (NOTE above)


@dataclass
class _Group:
    """Decode rows attended in one call. `index`: rows of the flattened cache [slots * kv_heads, d]
    to gather, [n, kv_heads, width] (positions past a row's end read its first token, masked)."""
    rows: slice | torch.Tensor  # rows of q (a slice when consecutive)
    index: torch.Tensor
    n: int
    width: int                  # KV tokens per row (padded)
    pad: torch.Tensor | None    # [n, 1, 1, width] bool, True past a row's end; None: no row padded
    cascade: int = -1           # >= 0: the private rest of that cascade's rows `members`
    members: torch.Tensor | None = None


@dataclass
class _Cascade:
    """Decode rows sharing their first blocks: those are read once for all of them."""
    rows: torch.Tensor          # [m] rows of q
    index: torch.Tensor         # [kv_heads, shared tokens] rows of the flattened cache
    tokens: int


@dataclass
class _Chunk:
    """A prefill chunk: rows lo:hi of q, the last positions of a ctx-token context."""
    lo: int
    hi: int
    ctx: int
    index: torch.Tensor         # [kv_heads, ctx] rows of the flattened cache
    mask: torch.Tensor | None   # [n, ctx] bool, None: causal from position 0 (no prefix)


@dataclass
class CpuAttentionPlan:
    num_tokens: int
    block_size: int
    kv_heads: int
    groups: list[_Group] = field(default_factory=list)
    cascades: list[_Cascade] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)
    slots: torch.Tensor | None = None  # slots written by store_kv_cpu (all >= 0)
    keep: torch.Tensor | None = None   # rows of key/value they come from; None: every row
    max_gather: int = 0                # rows of the largest gather (tokens x kv heads)
    work: int = 0                      # (query token, KV token) pairs per kv head: the layer's size


def _cut(order: np.ndarray, lens: np.ndarray, budget: int):
    """Consecutive runs of `order` (longest first) whose padded size n x longest <= budget."""
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and lens[order[start]] * (end + 1 - start) <= budget:
            end += 1
        yield order[start:end]
        start = end


def _shared_prefixes(rows, lens, tables, B, min_shared_tokens):
    """[(member rows, shared block count)] among decode `rows`: rows whose first block is the same
    physical block, and the leading columns on which all of them agree. The block holding a row's
    newest token is never shared, so every member keeps a private part."""
    cap = (lens[rows] - 1) // B
    rows = rows[cap >= 1]
    if len(rows) < 2 or not min_shared_tokens:
        return []
    found = []
    firsts, inverse, counts = np.unique(tables[rows, 0], return_inverse=True, return_counts=True)
    for u in np.flatnonzero(counts >= 2):
        members = rows[inverse == u]
        cols = int(((lens[members] - 1) // B).min())
        t = tables[members, :cols]
        agree = (t == t[:1]).all(0)
        s = cols if agree.all() else int(np.argmin(agree))
        if s * B * (len(members) - 1) >= min_shared_tokens:
            found.append((members, s))
    return found


def _cache_rows(tables, start, lens, width, B, kv_heads):
    """Flattened-cache rows [n, kv_heads, width] of tokens start .. start + width of each table
    row; a row's positions past lens[i] (its tokens from start on) read its first one."""
    pos = start + np.arange(width)
    slots = tables[:, pos // B] * B + pos % B
    slots = np.where(np.arange(width)[None, :] < lens[:, None], slots, slots[:, :1])
    return slots[:, None, :] * kv_heads + np.arange(kv_heads)[None, :, None]


def plan_attention(block_tables, cu_seqlens_q, seq_lens, *, block_size: int, kv_heads: int, slot_mapping=None,
                   group_tokens: int = GROUP_TOKENS, min_shared_tokens: int = MIN_SHARED_TOKENS) -> CpuAttentionPlan:
    """The host-side work of one step, for every layer. group_tokens: padded KV tokens per decode
    group (1: every decode row alone); min_shared_tokens: see the NOTE above (0: never shared)."""
    device = block_tables.device
    cu = cu_seqlens_q.cpu().numpy().astype(np.int64)
    lens = seq_lens.cpu().numpy().astype(np.int64)
    tables = block_tables.cpu().numpy().astype(np.int64)
    n_q = np.diff(cu)
    plan = CpuAttentionPlan(num_tokens=int(cu[-1]) if len(cu) else 0, block_size=block_size, kv_heads=kv_heads)
    B = block_size

    def tensor(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    def add_group(rows, skip, cascade=-1, members=None):
        ctx = lens[rows] - skip * B  # the tokens attended here: from block `skip` on
        width = int(ctx.max())
        pad = None
        if (ctx != width).any():
            pad = tensor(np.arange(width)[None, :] >= ctx[:, None])[:, None, None, :]
        q_rows = cu[rows]
        if len(rows) == 1 or (np.diff(q_rows) == 1).all():
            sel = slice(int(q_rows[0]), int(q_rows[0]) + len(rows))
        else:
            sel = tensor(q_rows)
        index = _cache_rows(tables[rows], skip * B, ctx, width, B, kv_heads)
        plan.groups.append(_Group(sel, tensor(index.reshape(-1)), len(rows), width, pad, cascade,
                                  None if members is None else tensor(members)))
        plan.max_gather = max(plan.max_gather, index.size)
        plan.work += index.size

    dec = np.flatnonzero(n_q == 1)
    shared = np.zeros(len(n_q), bool)
    for members, s in _shared_prefixes(dec, lens, tables, B, min_shared_tokens):
        c = len(plan.cascades)
        index = _cache_rows(tables[members[:1]], 0, np.array([s * B]), s * B, B, kv_heads)
        plan.cascades.append(_Cascade(tensor(cu[members]), tensor(index.reshape(-1)), s * B))
        plan.max_gather = max(plan.max_gather, index.size)
        plan.work += len(members) * index.size
        shared[members] = True
        rest = lens[members] - s * B
        for part in _cut(np.argsort(-rest, kind="stable"), rest, group_tokens):
            part = np.sort(part)
            add_group(members[part], s, c, part)
    dec = dec[~shared[dec]]
    for rows in _cut(dec[np.argsort(-lens[dec], kind="stable")], lens, group_tokens):
        add_group(np.sort(rows), 0)
    for i in np.flatnonzero(n_q > 1):
        ctx, n = int(lens[i]), int(n_q[i])
        mask = None
        if n != ctx:
            pos = torch.arange(ctx, device=device)
            mask = pos[None, :] <= pos[ctx - n:, None]
        index = _cache_rows(tables[i: i + 1], 0, np.array([ctx]), ctx, B, kv_heads)
        plan.chunks.append(_Chunk(int(cu[i]), int(cu[i + 1]), ctx, tensor(index.reshape(-1)), mask))
        plan.max_gather = max(plan.max_gather, index.size)
        plan.work += n * index.size
    if slot_mapping is not None:
        plan.slots, plan.keep = _slots(slot_mapping)
    return plan


def _slots(slot_mapping):
    """(slots written, rows of key/value they come from or None for every row)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return slot_mapping.long(), None
    rows = keep.nonzero().flatten()
    return slot_mapping[rows].long(), rows


_WORKSPACE: dict = {}


def _workspace(rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V buffers of at least `rows` rows of [d], kept between calls (one set inside inference
    mode, one outside: a tensor made in inference mode cannot be written outside it)."""
    d = like.shape[-1]
    key = (like.device, like.dtype, d, torch.is_inference_mode_enabled())
    buf = _WORKSPACE.get(key)
    if buf is None or buf.shape[1] < rows:
        buf = _WORKSPACE[key] = torch.empty((2, rows, d), dtype=like.dtype, device=like.device)
    return buf[0], buf[1]


def store_kv_cpu(key, value, k_cache, v_cache, slot_mapping, plan: CpuAttentionPlan | None = None):
    """store_kv_ref with the slot checks done once per step by the plan: one index_copy_ each."""
    if plan is None or plan.slots is None:
        check_store_kv(key, value, k_cache, v_cache, slot_mapping)
        slots, keep = _slots(slot_mapping)
    else:
        slots, keep = plan.slots, plan.keep
    if keep is not None:
        key, value = key[keep], value[keep]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):  # blocks not flat: index them
        B = k_cache.shape[1]
        k_cache[slots // B, slots % B] = key
        v_cache[slots // B, slots % B] = value
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)


def _partial(q, k, v, scale, pad=None):
    """Softmax attention in parts: (sum of exp(s - max) v, max, sum of exp(s - max)) over the
    keys of k/v [..., L, d] for q [..., n, d]; pad [..., n or 1, L] bool (True: not seen)."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if pad is not None:
        s.masked_fill_(pad, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = s.sub_(m).exp_()
    return torch.matmul(p, v), m, p.sum(-1, keepdim=True)


def paged_attention_cpu(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, scale, max_seqlen_q,
                        out=None, plan: CpuAttentionPlan | None = None):
    """paged_attention_ref's semantics; `plan` from plan_attention on the same batch (built here
    when None, with the full argument checks)."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if plan is None:
        check_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, out)
        plan = plan_attention(block_tables, cu_seqlens_q, seq_lens, block_size=block_size, kv_heads=kv_heads)
    elif (q.shape[0], block_size, kv_heads) != (plan.num_tokens, plan.block_size, plan.kv_heads):
        raise ValueError(f"plan: made for {plan.num_tokens} tokens, block size {plan.block_size} and "
                         f"{plan.kv_heads} kv heads; got {q.shape[0]}, {block_size} and {kv_heads}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):  # gathers read the flattened cache
        from kernels.reference import paged_attention_ref

        return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale=scale,
                                   max_seqlen_q=max_seqlen_q, out=out)
    if out is None:
        out = torch.empty_like(q)
    threads = torch.get_num_threads()
    if threads == 1 or plan.work >= ONE_THREAD_WORK:
        return _attend(q, k_cache, v_cache, scale, out, plan)
    torch.set_num_threads(1)
    try:
        return _attend(q, k_cache, v_cache, scale, out, plan)
    finally:
        torch.set_num_threads(threads)


def _attend(q, k_cache, v_cache, scale, out, plan: CpuAttentionPlan):
    kv_heads = k_cache.shape[2]
    num_heads, d = q.shape[1], q.shape[2]
    group = num_heads // kv_heads
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # the matmul paths' arithmetic
    kw, vw = _workspace(plan.max_gather, k_cache)
    k_rows, v_rows = k_cache.view(-1, d), v_cache.view(-1, d)

    def gather(index, *shape):
        k = torch.index_select(k_rows, 0, index, out=kw[: index.shape[0]]).view(*shape, d)
        v = torch.index_select(v_rows, 0, index, out=vw[: index.shape[0]]).view(*shape, d)
        return k.to(acc), v.to(acc)

    shared = []  # per cascade: its rows' parts over the shared tokens, each [m, kv_heads, group, *]
    for c in plan.cascades:
        m = c.rows.shape[0]
        k, v = gather(c.index, kv_heads, c.tokens)
        qc = q[c.rows].to(acc).view(m, kv_heads, group, d).transpose(0, 1).reshape(kv_heads, m * group, d)
        shared.append([t.view(kv_heads, m, group, -1).transpose(0, 1) for t in _partial(qc, k, v, scale)])
    for g in plan.groups:
        n = g.n
        k, v = gather(g.index, n, kv_heads, g.width)
        qg = q[g.rows].to(acc).view(n, kv_heads, group, d)
        if g.cascade < 0:
            s = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)
            if g.pad is not None:
                s.masked_fill_(g.pad, float("-inf"))
            o = torch.matmul(torch.softmax(s, -1), v)
        else:
            o2, m2, l2 = _partial(qg, k, v, scale, g.pad)
            o1, m1, l1 = (t[g.members] for t in shared[g.cascade])
            mx = torch.maximum(m1, m2)
            a1, a2 = (m1 - mx).exp_(), (m2 - mx).exp_()
            o = (o1 * a1 + o2 * a2).div_(l1 * a1 + l2 * a2)
        out[g.rows] = o.reshape(n, num_heads, d).to(out.dtype)
    for c in plan.chunks:
        k = torch.index_select(k_rows, 0, c.index, out=kw[: c.index.shape[0]]).view(1, kv_heads, c.ctx, d)
        v = torch.index_select(v_rows, 0, c.index, out=vw[: c.index.shape[0]]).view(1, kv_heads, c.ctx, d)
        o = F.scaled_dot_product_attention(q[c.lo: c.hi].unsqueeze(0).transpose(1, 2), k, v, attn_mask=c.mask,
                                           is_causal=c.mask is None, scale=scale, enable_gqa=True)
        out[c.lo: c.hi] = o[0].transpose(0, 1)
    return out


def plan_step(q, key, value, k_cache, v_cache, slot_mapping, block_tables, cu_seqlens_q, seq_lens, *, scale,
              max_seqlen_q, group_tokens: int | None = None, min_shared_tokens: int | None = None) -> CpuAttentionPlan:
    """plan_attention after the full checks of store_kv and paged_attention on a layer's arguments:
    the first layer of a step pays for them, the others reuse the plan. None: the module's defaults."""
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    check_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, None)
    return plan_attention(block_tables, cu_seqlens_q, seq_lens, block_size=k_cache.shape[1],
                          kv_heads=k_cache.shape[2], slot_mapping=slot_mapping,
                          group_tokens=GROUP_TOKENS if group_tokens is None else group_tokens,
                          min_shared_tokens=MIN_SHARED_TOKENS if min_shared_tokens is None else min_shared_tokens)
