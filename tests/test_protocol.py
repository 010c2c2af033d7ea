"""radixkv.protocol: every message survives msgpack both ways, and the decoders refuse
what does not belong to their direction."""

import msgspec
import pytest

from radixkv import protocol as P


def _stats(**kw):
    base = dict(num_blocks=10, block_size=16, free_blocks=4, evictable_blocks=3, in_use_blocks=3, running=1, waiting=2)
    return P.EngineStats(**{**base, **kw})


TO_WORKER = [
    P.GenerateRequest("r1", [1, 2, 3], P.SamplingOptions()),
    P.GenerateRequest(
        "r2", [5], P.SamplingOptions(n=3, best_of=4, max_tokens=None, temperature=0.0, top_k=5, min_p=0.1, seed=7,
                                      stop_token_ids=[2], ignore_eos=True, min_tokens=2, logprobs=3),
        cache_salt="tenant-a",
    ),
    P.AbortRequest(["r1", "r2"]),
]

FROM_WORKER = [
    P.WorkerReady(123, P.PROTOCOL_VERSION, 10, 16, 160, 2048, _stats()),
    P.StepOutput([]),
    P.StepOutput(
        [
            P.RequestDelta("r1", [P.ChoiceDelta(0, [7, 8])], 3, 0),
            P.RequestDelta(
                "r2",
                [P.ChoiceDelta(1, [9], [-0.5], [{9: -0.5, 4: -1.25}], "length")],
                1, 0, finished=True,
            ),
        ],
        stats=_stats(preemptions=2, prefix_hit_tokens=32, invariant_checks=5),
    ),
    P.RequestRejected("r3", "max_tokens: too many"),
    P.WorkerFatal("RuntimeError: boom"),
]


@pytest.mark.parametrize("msg", TO_WORKER)
def test_to_worker_roundtrip(msg):
    assert P.make_decoder("to_worker").decode(P.make_encoder().encode(msg)) == msg


@pytest.mark.parametrize("msg", FROM_WORKER)
def test_from_worker_roundtrip(msg):
    assert P.make_decoder("from_worker").decode(P.make_encoder().encode(msg)) == msg


def test_direction_is_enforced():
    enc = P.make_encoder()
    with pytest.raises(msgspec.ValidationError):
        P.make_decoder("to_worker").decode(enc.encode(P.WorkerFatal("x")))
    with pytest.raises(msgspec.ValidationError):
        P.make_decoder("from_worker").decode(enc.encode(P.AbortRequest(["a"])))
    with pytest.raises(ValueError, match="direction"):
        P.make_decoder("sideways")


def test_wrong_field_types_are_rejected():
    enc = P.make_encoder()
    bad = enc.encode({"type": "generate", "request_id": "r", "prompt_token_ids": ["a"], "sampling": {}})
    with pytest.raises(msgspec.ValidationError, match="prompt_token_ids"):
        P.make_decoder("to_worker").decode(bad)


def test_sampling_options_mirror_engine_sampling_params():
    """The worker builds SamplingParams(**options): every option must be a SamplingParams field
    with the same default, or requests would change meaning across the boundary."""
    import dataclasses

    from radixkv.engine.sampling_params import SamplingParams

    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    for name in P.SamplingOptions.__struct_fields__:
        assert name in fields, name
        f = fields[name]
        engine_default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert getattr(P.SamplingOptions(), name) == engine_default, name


def test_worker_config_json_roundtrip():
    cfg = P.WorkerConfig("ipc:///tmp/x/req", "ipc:///tmp/x/out", 42, {"model_dir": "m", "num_blocks": 8,
                                                                          "enable_prefix_caching": False})
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=P.WorkerConfig) == cfg
