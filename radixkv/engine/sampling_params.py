"""The engine's SamplingParams is the one definition in radixkv/sampling_params.py (torch-free, shared
with the front and the wire); this module keeps the engine's import path."""

from radixkv.sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = ["MAX_LOGPROBS", "SamplingParams"]
