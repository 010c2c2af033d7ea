"""Argument checks shared by the Triton kernels and their references.

Shape, dtype and device checks are host-side metadata reads and always run. Checks
on tensor *values* (slot ranges, sequence lengths) would force a host-device sync on
the GPU, so they run only when the tensor already lives on the CPU.
"""

import torch

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: references only
INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(name: str, msg: str):
    raise ValueError(f"{name}: {msg}")


def check_tensor(name, t, *, ndim=None, dtypes=None, device=None):
    if not isinstance(t, torch.Tensor):
        _fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        _fail(name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(name, f"dtype {t.dtype} not in {tuple(str(d) for d in dtypes)}")
    if device is not None and t.device != device:
        _fail(name, f"on {t.device}, expected {device}")


def check_cache_pair(k_cache, v_cache):
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_DTYPES, device=k_cache.device)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        _fail("v_cache", f"{tuple(v_cache.shape)} {v_cache.dtype} does not match k_cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1:
            _fail(name, "last dim (head_dim) must be contiguous")


def check_store_kv(key, value, k_cache, v_cache, slot_mapping):
    check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    dev = k_cache.device
    check_tensor("key", key, ndim=3, dtypes=(k_cache.dtype,), device=dev)
    check_tensor("value", value, ndim=3, dtypes=(k_cache.dtype,), device=dev)
    if tuple(key.shape[1:]) != (kv_heads, head_dim):
        _fail("key", f"shape {tuple(key.shape)} does not fit [T, {kv_heads}, {head_dim}]")
    if value.shape != key.shape:
        _fail("value", f"shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    if slot_mapping.shape[0] != key.shape[0]:
        _fail("slot_mapping", f"{slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    for name, t in (("key", key), ("value", value)):
        if t.stride(-1) != 1:
            _fail(name, "last dim (head_dim) must be contiguous")
    if dev.type == "cpu" and slot_mapping.numel():
        hi = int(slot_mapping.max())
        if hi >= num_blocks * block_size:
            _fail("slot_mapping", f"slot {hi} >= num_blocks * block_size = {num_blocks * block_size}")
        valid = slot_mapping[slot_mapping >= 0]
        if valid.numel() != valid.unique().numel():
            _fail("slot_mapping", "the same slot is written twice")


def check_copy_blocks(kv_cache, block_mapping):
    check_tensor("kv_cache", kv_cache, ndim=6, dtypes=KV_DTYPES)
    if kv_cache.shape[1] != 2:
        _fail("kv_cache", f"expected [L, 2, N, B, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    if not kv_cache[0, 0, 0].is_contiguous():
        _fail("kv_cache", "each block [B, kv_heads, head_dim] must be contiguous")
    check_tensor("block_mapping", block_mapping, ndim=2, dtypes=(torch.int64,))
    if block_mapping.shape[1] != 2:
        _fail("block_mapping", f"expected [n, 2] (src, dst), got {tuple(block_mapping.shape)}")
    if block_mapping.device.type == "cpu" and block_mapping.numel():
        n_blocks = kv_cache.shape[2]
        if int(block_mapping.min()) < 0 or int(block_mapping.max()) >= n_blocks:
            _fail("block_mapping", f"block ids must lie in [0, {n_blocks})")
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        if dst.unique().numel() != dst.numel():
            _fail("block_mapping", "a destination block appears twice")
        if torch.isin(dst, src).any():
            _fail("block_mapping", "a destination block is also a source (copies run concurrently)")


def check_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                    max_seqlen_q, out):
    check_cache_pair(k_cache, v_cache)
    _, block_size, kv_heads, head_dim = k_cache.shape
    dev = k_cache.device
    check_tensor("q", q, ndim=3, dtypes=(k_cache.dtype,), device=dev)
    num_tokens, num_heads, qd = q.shape
    if qd != head_dim:
        _fail("q", f"head_dim {qd} differs from the cache's {head_dim}")
    if num_heads % kv_heads:
        _fail("q", f"{num_heads} query heads is not a multiple of {kv_heads} kv heads")
    if q.stride(-1) != 1:
        _fail("q", "last dim (head_dim) must be contiguous")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=dev)
    batch = block_tables.shape[0]
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=dev)
    if cu_seqlens_q.shape[0] != batch + 1:
        _fail("cu_seqlens_q", f"length {cu_seqlens_q.shape[0]}, expected batch + 1 = {batch + 1}")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=dev)
    if seq_lens.shape[0] != batch:
        _fail("seq_lens", f"length {seq_lens.shape[0]}, expected batch = {batch}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        _fail("scale", f"expected a positive float, got {scale!r}")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 1:
        _fail("max_seqlen_q", f"expected a positive int, got {max_seqlen_q!r}")
    if max_seqlen_q * q.stride(0) >= 2 ** 31:  # the kernel's in-chunk offsets are 32-bit
        _fail("max_seqlen_q", f"chunks of {max_seqlen_q} tokens x {q.stride(0)} elements exceed 2^31")
    if out is not None:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=dev)
        if out.shape != q.shape or out.stride(-1) != 1:
            _fail("out", f"shape {tuple(out.shape)} must equal q's {tuple(q.shape)}, last dim contiguous")
        if max_seqlen_q * out.stride(0) >= 2 ** 31:
            _fail("max_seqlen_q", f"chunks of {max_seqlen_q} tokens x {out.stride(0)} elements exceed 2^31")
    if dev.type == "cpu" and batch:
        cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
        n_q = [b - a for a, b in zip(cu, cu[1:])]
        if cu[0] != 0 or cu[-1] != num_tokens or min(n_q) < 0:
            _fail("cu_seqlens_q", f"must rise from 0 to num_tokens = {num_tokens}, got {cu}")
        if max(n_q) > max_seqlen_q:
            _fail("max_seqlen_q", f"{max_seqlen_q} < longest query chunk {max(n_q)}")
        if any(s < n for s, n in zip(lens, n_q)):
            _fail("seq_lens", "a context is shorter than its query chunk")
        if max(lens) > block_tables.shape[1] * block_size:
            _fail("seq_lens", f"a context exceeds max_blocks * block_size = "
                              f"{block_tables.shape[1] * block_size}")
        used = torch.arange(block_tables.shape[1]) < (seq_lens.long() + block_size - 1)[:, None] // block_size
        ids = block_tables[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= k_cache.shape[0]):
            _fail("block_tables", f"a used entry lies outside [0, {k_cache.shape[0]})")
