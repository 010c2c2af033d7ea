"""Messages that cross the ZeroMQ boundary between the front and the engine worker.

This module is the only code both processes share: it imports msgspec and the torch-free
radixkv.sampling_params, nothing of the engine's runtime, so the front never loads torch for
it. Every message is a tagged msgspec struct encoded with msgpack; one decoder per direction
decodes the union.

Front -> worker (one PUSH/PULL pipe):  GenerateRequest, AbortRequest.
Worker -> front (another pipe):        WorkerReady, StepOutput, RequestRejected, Heartbeat, WorkerFatal.

A StepOutput carries every request that had news in one engine step, so the
message rate follows the step rate, not the token rate.
"""

from typing import Union

import msgspec

PROTOCOL_VERSION = 1


def _sampling_options() -> type:
    """SamplingParams' fields, types and defaults as a msgspec struct.

    NOTE: the wire form is derived, not written: radixkv/sampling_params.py (torch-free, like
    this module) holds the one field list, and a field added there crosses the wire with no edit
    here. A dataclass is not the wire type itself because msgspec would encode every field of it
    (no omit_defaults) and ignore unknown ones instead of refusing them. The worker rebuilds the
    dataclass with SamplingParams(**msgspec.structs.asdict(options)) and validates it; the text
    fields (stop, ...) travel too, and the engine ignores them."""
    import dataclasses
    import typing

    from radixkv.sampling_params import SamplingParams

    hints = typing.get_type_hints(SamplingParams)
    spec = [(f.name, hints[f.name], f.default_factory() if f.default_factory is not dataclasses.MISSING
             else f.default) for f in dataclasses.fields(SamplingParams)]
    return msgspec.defstruct("SamplingOptions", spec, omit_defaults=True, forbid_unknown_fields=True,
                             module=__name__)


SamplingOptions = _sampling_options()


def sampling_options(params) -> "SamplingOptions":
    """A validated SamplingParams as it goes on the wire."""
    return SamplingOptions(**{name: getattr(params, name) for name in SamplingOptions.__struct_fields__})


# ---- front -> worker -------------------------------------------------------------------------


class GenerateRequest(msgspec.Struct, tag="generate", omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    cache_salt: Union[str, None] = None


class AbortRequest(msgspec.Struct, tag="abort"):
    request_ids: list[str]


# ---- worker -> front -------------------------------------------------------------------------


class EngineStats(msgspec.Struct, omit_defaults=True):
    """A snapshot of the engine and its block pool; counters are totals since start."""

    num_blocks: int
    block_size: int
    free_blocks: int
    evictable_blocks: int
    in_use_blocks: int
    running: int
    waiting: int
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    invariant_checks: int = 0  # idle-time cache invariant checks that passed
    requests_failed: int = 0  # requests the engine failed ("error") and went on without


class WorkerReady(msgspec.Struct, tag="ready"):
    pid: int
    protocol_version: int
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    stats: EngineStats


class ChoiceDelta(msgspec.Struct, omit_defaults=True, array_like=True):
    index: int
    new_token_ids: list[int]
    logprobs: Union[list[float], None] = None
    # per new token: {token id: logprob} of the most likely tokens, when asked for
    top_logprobs: Union[list[dict[int, float]], None] = None
    # None | "stop" | "length" | "abort" | "error" (the engine failed this request; the worker logged why)
    finish_reason: Union[str, None] = None


class RequestDelta(msgspec.Struct, omit_defaults=True, array_like=True):
    request_id: str
    choices: list[ChoiceDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool = False


class StepOutput(msgspec.Struct, tag="step", omit_defaults=True):
    outputs: list[RequestDelta]
    stats: Union[EngineStats, None] = None


class RequestRejected(msgspec.Struct, tag="rejected", omit_defaults=True):
    """add_request refused the request: bad input the front could not see (e.g. the pool is too
    small). `param` names the request field at fault, when one is."""

    request_id: str
    message: str
    param: Union[str, None] = None


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Sent by the worker's loop at least every heartbeat_interval_s, busy or idle: a front that
    hears nothing for much longer knows the loop is stuck (a frozen process), not just busy."""

    steps: int  # engine steps run since start


class WorkerFatal(msgspec.Struct, tag="fatal"):
    """The worker cannot go on (start-up failed, the engine raised); it exits right after."""

    message: str


ToWorker = Union[GenerateRequest, AbortRequest]
FromWorker = Union[WorkerReady, StepOutput, RequestRejected, Heartbeat, WorkerFatal]


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """How the front starts a worker: passed as JSON on the worker's command line."""

    request_addr: str  # the worker PULLs requests here
    output_addr: str  # the worker PUSHes outputs here
    parent_pid: int
    engine_args: dict[str, Union[str, int, float, bool, None]]
    stats_interval_s: float = 0.5
    heartbeat_interval_s: float = 1.0
    torch_threads: Union[int, None] = None  # None: every core but one, which the front needs


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def make_decoder(direction: str) -> msgspec.msgpack.Decoder:
    """direction "to_worker" or "from_worker"."""
    if direction == "to_worker":
        return msgspec.msgpack.Decoder(ToWorker)
    if direction == "from_worker":
        return msgspec.msgpack.Decoder(FromWorker)
    raise ValueError(f"direction must be 'to_worker' or 'from_worker', got {direction!r}")
