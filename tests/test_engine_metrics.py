"""Engine metrics and outputs as typed values: EngineMetrics converts to the wire's EngineStats
with no field dropped or mixed up, RequestOutput to RequestDelta likewise, and a request's
sharing accounting comes on its finished output only, the same figures the engine sums."""

import dataclasses
import random

import msgspec
import pytest

from radixkv import protocol as P
from radixkv.cache import CacheStats
from radixkv.engine import worker as worker_module
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.metrics import EngineCounters, EngineMetrics, to_engine_stats
from radixkv.engine.outputs import CompletionOutput, RequestOutput, SharingStats, to_delta
from radixkv.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIRE_FIELDS = set(P.EngineStats.__struct_fields__)
WORKER_FIELDS = {"invariant_checks"}  # counted by the worker, which runs the idle checks


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _wire_source(m: EngineMetrics, invariant_checks: int, name: str):
    """Where the wire field `name` comes from: the cache's snapshot, the engine's, or the worker."""
    if name in WORKER_FIELDS:
        return invariant_checks
    return getattr(m.cache, name) if name in _names(CacheStats) else getattr(m, name)


def _check_wire(m: EngineMetrics, invariant_checks: int) -> P.EngineStats:
    wire = to_engine_stats(m, invariant_checks)
    assert set(msgspec.structs.asdict(wire)) == WIRE_FIELDS
    assert {n: getattr(wire, n) for n in WIRE_FIELDS} == {n: _wire_source(m, invariant_checks, n) for n in WIRE_FIELDS}
    back = msgspec.msgpack.Decoder(P.FromWorker).decode(P.make_encoder().encode(P.StepOutput([], wire)))
    assert back.stats == wire
    return wire


def test_metrics_fields_are_the_engine_figures_and_cover_the_wire():
    assert _names(EngineMetrics) == _names(EngineCounters) | {
        "running", "waiting", "preemptions", "beam_reserved_blocks", "num_blocks", "block_size", "max_model_len",
        "cache"}
    assert _names(EngineCounters) == {
        "prompt_tokens", "cached_prompt_tokens", "generation_tokens", "computed_tokens", "computed_prompt_tokens",
        "steps", "requests_finished", "requests_failed", "block_steps_held", "block_steps_without_sharing"}
    # every wire field has a source of the same name
    assert WIRE_FIELDS <= (_names(EngineMetrics) - {"cache"}) | _names(CacheStats) | WORKER_FIELDS


def test_metrics_round_trip_to_the_wire_with_every_field():
    """Distinct values everywhere: a field dropped (left at its default) or taken from another
    field shows up."""
    values = iter(range(101, 1000))
    cache = CacheStats(**{f.name: next(values) for f in dataclasses.fields(CacheStats) if f.name != "per_salt"})
    own = {f.name: next(values) for f in dataclasses.fields(EngineMetrics) if f.name != "cache"}
    own.update(num_blocks=cache.num_blocks, block_size=cache.block_size)  # the same figures, twice
    m = EngineMetrics(**own, cache=cache)
    wire = _check_wire(m, invariant_checks=next(values))
    defaults = P.EngineStats(num_blocks=0, block_size=0, free_blocks=0, evictable_blocks=0, in_use_blocks=0,
                             running=0, waiting=0)
    assert all(getattr(wire, n) != getattr(defaults, n) for n in WIRE_FIELDS)


def _engine(model_dir, **kw):
    args = dict(device="cpu", block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32)
    args.update(kw)
    return Engine(EngineConfig(model_dir=str(model_dir), **args))


def _prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def test_engine_metrics_after_a_run_and_on_the_wire(tiny_llama_dir):
    e = _engine(tiny_llama_dir)
    prompts = {"a": _prompt(10), "pair": _prompt(9, seed=1)}
    e.add_request("a", prompts["a"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    e.add_request("pair", prompts["pair"], SamplingParams(n=2, seed=3, max_tokens=6, ignore_eos=True))
    outputs = []
    while e.has_unfinished_requests():
        outputs += e.step()
    m = e.metrics()
    assert isinstance(m, EngineMetrics) and isinstance(m.cache, CacheStats)
    assert m.prompt_tokens == 19 and m.generation_tokens == 5 + 2 * 6
    assert m.computed_prompt_tokens == 19 and m.computed_tokens == 19 + 4 + 2 * 5
    assert m.requests_finished == 2 and m.requests_failed == 0 and m.running == m.waiting == 0
    assert (m.num_blocks, m.block_size) == (m.cache.num_blocks, m.cache.block_size) == (64, 4)
    assert m.cache.in_use_blocks == 0 and m.cache.prefix_query_tokens == 19

    # sharing: on each request's finished output only; the engine's sums are those figures
    finished = {o.request_id: o for o in outputs if o.finished}
    assert set(finished) == {"a", "pair"}
    assert all(o.sharing is None for o in outputs if not o.finished)
    assert m.block_steps_held == sum(o.sharing.block_steps_held for o in finished.values())
    assert m.block_steps_without_sharing == sum(o.sharing.block_steps_without_sharing for o in finished.values())
    alone, pair = finished["a"].sharing, finished["pair"].sharing
    assert alone == SharingStats(4, 4, alone.block_steps_held, alone.block_steps_held, 10)  # 14 tokens: 4 blocks
    assert pair.num_computed_prompt_tokens == 9 and pair.blocks_held < pair.blocks_without_sharing == 2 * 4

    _check_wire(m, invariant_checks=2)
    # a snapshot: later work changes the engine's counters, not it
    e.add_request("b", _prompt(5, seed=2), SamplingParams(max_tokens=1))
    assert e.counters.prompt_tokens == 24 and m.prompt_tokens == 19


def test_the_worker_converts_with_the_one_conversion_of_each_kind():
    assert worker_module.to_delta is to_delta
    assert worker_module.to_engine_stats is to_engine_stats


def test_request_output_to_delta_fills_every_field():
    lps = [{7: -0.5, 9: -1.0}, {8: -0.25, 7: -2.0}]
    out = RequestOutput("r", [CompletionOutput(1, [7, 8], [5, 7, 8], lps, "length", -0.75),
                              CompletionOutput(0, [4], [4], None, None, -0.1)], [1, 2, 3], 2, False)
    d = to_delta(out)
    assert d == P.RequestDelta("r", [P.ChoiceDelta(1, [7, 8], [-0.5, -0.25], lps, "length"),
                                     P.ChoiceDelta(0, [4], None, None, None)], 3, 2, False)
    finished = dataclasses.replace(out, finished=True, sharing=SharingStats(1, 2, 3, 4, 5))
    assert to_delta(finished).finished is True
    back = msgspec.msgpack.Decoder(P.FromWorker).decode(P.make_encoder().encode(P.StepOutput([d])))
    assert back.outputs == [d]
