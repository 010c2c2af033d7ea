"""Shared helpers of the kernel tests (no tests here): random paged-attention problems.

Every call draws fresh data; the seed is part of the returned case so a failure can be
replayed. Block tables are shuffled (non-contiguous physical blocks) and their unused
tail entries hold -1, so a kernel that reads past a sequence's blocks goes wrong visibly.
"""

import random
from dataclasses import dataclass

import torch


@dataclass
class Case:
    seed: int
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    scale: float

    def args(self, dtype=None):
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        return (cast(self.q), cast(self.k_cache), cast(self.v_cache), self.block_tables,
                self.cu_seqlens_q, self.seq_lens)


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def make_case(n_q, ctx, *, block_size, kv_heads, group, head_dim, dtype, device="cpu",
              spare_blocks=3, max_blocks=None, seed=None) -> Case:
    """n_q[i] query tokens ending a ctx[i]-token context, for each sequence i."""
    assert len(n_q) == len(ctx) and all(0 <= n <= c for n, c in zip(n_q, ctx))
    seed = fresh_seed() if seed is None else seed
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in ctx]
    max_blocks = max(max(need), 1) if max_blocks is None else max_blocks
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.full((len(ctx), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    shape = (num_blocks, block_size, kv_heads, head_dim)
    gd = torch.Generator(device=device).manual_seed(seed)  # big tensors drawn where they live
    k_cache = torch.randn(shape, generator=gd, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gd, device=device).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(n_q).cumsum(0).tolist()), dtype=torch.int32)
    q = torch.randn((int(cu[-1]), kv_heads * group, head_dim), generator=gd, device=device).to(dtype)
    return Case(seed, q, k_cache, v_cache, tables.to(device),
                cu.to(device), torch.tensor(ctx, dtype=torch.int32, device=device),
                max(max(n_q), 1), head_dim ** -0.5)


def poisoned_out(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def assert_close(out, ref, tol, seed, what=""):
    """Norm-wise relative error under tol, every row written and within 10x tol."""
    out64, ref64 = out.double(), ref.double().to(out.device)
    assert not torch.isnan(out64).any(), f"{what} unwritten (NaN) output elements; seed={seed}"
    err = (out64 - ref64).norm() / ref64.norm()
    assert err < tol, f"{what} relative error {err:.3e} >= {tol}; seed={seed}"
    row_err = (out64 - ref64).norm(dim=-1) / ref64.norm(dim=-1).clamp_min(1e-6)
    assert row_err.max() < 10 * tol, f"{what} worst row error {row_err.max():.3e}; seed={seed}"


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
