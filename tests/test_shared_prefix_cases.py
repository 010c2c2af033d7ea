"""Shared helpers of the shared-prefix tests (no tests here): seeded batches whose block
tables are laid out the way the radix tree lays them out (a shared prefix is the same
physical ids), rows in shuffled order, unused table entries -1."""

import random
from dataclasses import dataclass

import torch

from kernels.shared_prefix import PrefixGroups


def random_forest(rng: random.Random, *, block_size, num_blocks, max_roots=3, max_rows=9,
                  root_blocks=(0, 4), child_blocks=(0, 3), private_blocks=(1, 3)):
    """Rows (table, seq_len): a few roots (system prompts), each with a few children
    (few-shot sets), each with a few rows of private blocks; a 0-block root or child
    shares nothing. The block holding a row's newest token is always its own."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    take = lambda n: [pool.pop() for _ in range(n)]  # noqa: E731
    rows = []
    for _ in range(rng.randint(1, max_roots)):
        root = take(rng.randint(*root_blocks))
        for _ in range(rng.randint(1, 3)):
            child = take(rng.randint(*child_blocks))
            for _ in range(rng.randint(1, 3)):
                if len(rows) < max_rows:
                    rows.append(root + child + take(rng.randint(*private_blocks)))
    rng.shuffle(rows)
    lens = [(len(t) - 1) * block_size + rng.randint(1, block_size) for t in rows]
    return rows, lens


def as_tensors(rows, lens, device="cpu", width=None):
    width = max(len(r) for r in rows) if width is None else width
    padded = [r + [-1] * (width - len(r)) for r in rows]
    return (torch.tensor(padded, dtype=torch.int32, device=device).view(len(rows), width),
            torch.tensor(lens, dtype=torch.int32, device=device))


def lcp(a, b, limit):
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Problem:
    seed: int
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float


def make_problem(rows, lens, *, block_size, num_blocks, kv_heads, qpk, head_dim, dtype, device,
                 seed):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g, device=device).to(dtype)
    v = torch.randn(shape, generator=g, device=device).to(dtype)
    q = torch.randn((len(rows), kv_heads * qpk, head_dim), generator=g, device=device).to(dtype)
    bt, sl = as_tensors(rows, lens, device)
    return Problem(seed, q, k, v, bt, sl, head_dim ** -0.5)


def hand_groups(segments, batch, device="cpu"):
    """PrefixGroups from [(block ids, length in tokens, member rows)], levels in list order
    per row (the caller makes the tables agree)."""
    width = max([len(s[0]) for s in segments] + [1])
    tab = [list(s[0]) + [0] * (width - len(s[0])) for s in segments]
    cu, members, per_row = [0], [], [[] for _ in range(batch)]
    for g, (_, _, rows) in enumerate(segments):
        for b in rows:
            per_row[b].append(len(members))
            members.append(b)
        cu.append(len(members))
    levels = max([len(r) for r in per_row] + [0])
    slots = [r + [-1] * (levels - len(r)) for r in per_row]
    starts = [sum(segments[g][1] for g in range(len(segments)) if b in segments[g][2])
              for b in range(batch)]
    i32 = dict(dtype=torch.int32, device=device)
    return PrefixGroups(
        block_tables=torch.tensor(tab, **i32).view(len(segments), width),
        shared_lens=torch.tensor([s[1] for s in segments], **i32),
        cu_members=torch.tensor(cu, **i32), members=torch.tensor(members, **i32),
        seq_slots=torch.tensor(slots, **i32).view(batch, levels),
        private_start=torch.tensor(starts, **i32),
        max_members=max([len(s[2]) for s in segments] + [0]),
        max_shared_len=max([s[1] for s in segments] + [0]))


def tree_batch(rng: random.Random, batch, *, level_blocks, fanout, private_tokens, block_size):
    """`batch` rows under a tree: level l cuts every node into fanout[l] parts holding
    level_blocks[l] fresh blocks each; then each row's private tokens (a (lo, hi) range)."""
    num_blocks = batch * (sum(level_blocks) + private_tokens[1] // block_size + 2)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    take = lambda n: [ids.pop() for _ in range(n)]  # noqa: E731
    rows = [[] for _ in range(batch)]
    parts = [list(range(batch))]
    for nblk, fan in zip(level_blocks, fanout):
        parts = [p[i::fan] for p in parts for i in range(fan) if p[i::fan]]
        for p in parts:
            seg = take(nblk)
            for b in p:
                rows[b] += seg
    lens = []
    for r in rows:
        n = rng.randint(*private_tokens)
        r += take(_cdiv(n, block_size))
        lens.append((len(r) - _cdiv(n, block_size)) * block_size + n)
    return rows, lens, num_blocks


def _cdiv(a, b):
    return -(-a // b)
