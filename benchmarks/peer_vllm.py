"""vLLM's v1 KVCacheManager driven through the cache_ops trace, through its public classes.

Installed by the `peers` extra (pyproject.toml): vLLM itself without its dependencies
(its v1 core is plain Python; the wheel's compiled parts are never loaded on this path)
plus the few packages that `vllm.v1.core.kv_cache_manager` imports. torch is radixkv's
own (the `engine` extra).

The driver does what vLLM's scheduler does for one request at a time, with the same
defaults as a vLLM server: sha256 (pickle) block hashes computed by the request's block
hasher, prefix caching on, one full-attention KV cache group. Per request:

- lookup:  Request(...) (hashes the prompt's full blocks) + get_computed_blocks()
- prefill: allocate_slots() for the uncached prompt tokens (it also caches the full
           blocks, i.e. vLLM's commit)
- decode:  append_output_token_ids() (hashes new full blocks) + allocate_slots(), per
           chunk of output tokens
- free:    free()

vLLM keeps block 0 as its null block, so it gets num_blocks + 1 blocks: both managers
hand out the same number. Evictions are counted from vLLM's BlockRemoved events in a
separate, untimed run (events cost time); hits from what get_computed_blocks returns.
"""

import statistics
import time

from benchmarks.cache_ops import heap_after_trace


def load():
    """(module namespace, None) when vLLM's core imports, else (None, 'why not')."""
    try:
        import torch
        import vllm
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request
    except Exception as e:  # ImportError, or a compiled part that fails to load here
        return None, (f"{type(e).__name__}: {e}; install it with pip install '.[peers]' && "
                      "pip install --no-deps vllm==0.33.0")
    return dict(torch=torch, version=vllm.__version__, BlockRemoved=BlockRemoved, SamplingParams=SamplingParams,
                sha256=sha256, KVCacheManager=KVCacheManager, get_request_block_hasher=get_request_block_hasher,
                init_none_hash=init_none_hash, FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig,
                KVCacheGroupSpec=KVCacheGroupSpec, Request=Request), None


class VllmPeer:
    def __init__(self, v: dict, num_blocks: int, block_size: int, max_model_len: int):
        self.v, self.B, self.max_model_len = v, block_size, max_model_len
        v["init_none_hash"](v["sha256"])
        spec = v["FullAttentionSpec"](block_size=block_size, num_kv_heads=1, head_size=1, dtype=v["torch"].float16)
        self.config = v["KVCacheConfig"](num_blocks=num_blocks + 1, kv_cache_tensors=[],
                                          kv_cache_groups=[v["KVCacheGroupSpec"](["layers.0"], spec)])
        self.hasher = v["get_request_block_hasher"](block_size, v["sha256"])

    def make(self, events: bool = False):
        return self.v["KVCacheManager"](self.config, max_model_len=self.max_model_len, scheduler_block_size=self.B,
                                        hash_block_size=self.B, enable_caching=True,
                                        enable_kv_cache_events=events)

    def run_trace(self, m, trace, decode_chunk: int, timers=None, on_request=None) -> tuple[int, int]:
        """Drive the trace; returns (hit tokens, prompt tokens). With `timers` (name ->
        [seconds, calls]) time every phase; `on_request(m)` runs after each request."""
        Request, SamplingParams, hasher = self.v["Request"], self.v["SamplingParams"], self.hasher
        clock = time.perf_counter
        hits = query = 0
        for i, (prompt, out) in enumerate(trace):
            t0 = clock()
            req = Request(str(i), prompt, SamplingParams(max_tokens=len(out)), None, block_hasher=hasher)
            blocks, hit, _ = m.get_computed_blocks(req)
            t1 = clock()
            assert m.allocate_slots(req, len(prompt) - hit, hit, blocks) is not None
            req.num_computed_tokens = len(prompt)
            t2 = clock()
            decode = 0.0
            for j in range(0, len(out), decode_chunk):
                t3 = clock()
                piece = out[j : j + decode_chunk]
                req.append_output_token_ids(piece)
                assert m.allocate_slots(req, len(piece)) is not None
                req.num_computed_tokens += len(piece)
                decode += clock() - t3
            t4 = clock()
            m.free(req)
            t5 = clock()
            hits += hit
            query += len(prompt)
            if timers is not None:
                for name, t, n in (("lookup", t1 - t0, 1), ("prefill", t2 - t1, 1),
                                   ("decode", decode, -(-len(out) // decode_chunk)), ("free", t5 - t4, 1)):
                    acc = timers.setdefault(name, [0.0, 0])
                    acc[0] += t
                    acc[1] += n
            if on_request is not None:
                on_request(m)
        return hits, query


def measure(trace, num_blocks: int, block_size: int, decode_chunk: int, runs: int) -> dict:
    v, why = load()
    if v is None:
        return {"error": why}
    max_model_len = max(len(p) + len(o) for p, o in trace) + block_size
    peer = VllmPeer(v, num_blocks, block_size, max_model_len)
    walls = []
    for _ in range(runs):
        m = peer.make()
        t0 = time.perf_counter()
        hits, query = peer.run_trace(m, trace, decode_chunk)
        walls.append(time.perf_counter() - t0)
    timers: dict = {}
    peer.run_trace(peer.make(), trace, decode_chunk, timers)
    removed = [0]
    BlockRemoved = v["BlockRemoved"]

    def count_removed(m):
        removed[0] += sum(len(e.block_hashes) for e in m.take_events() if isinstance(e, BlockRemoved))

    ev_hits, _ = peer.run_trace(peer.make(events=True), trace, decode_chunk, on_request=count_removed)
    assert ev_hits == hits
    heap = heap_after_trace(peer.make, lambda m: peer.run_trace(m, trace, decode_chunk))
    return {"name": f"vLLM {v['version']} v1 KVCacheManager", "version": v["version"],
            "wall_s_median": statistics.median(walls), "wall_s_runs": walls, "hit_tokens": hits,
            "query_tokens": query, "hit_rate": hits / query, "evicted_blocks": removed[0],
            "phases": {k: {"calls": c, "us_per_op": 1e6 * t / c} for k, (t, c) in timers.items()}, "heap": heap}
