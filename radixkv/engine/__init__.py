"""The engine: scheduler, model runner, sampler, step loop and the offline LLM API.

    from radixkv.engine.engine import Engine, EngineConfig, RequestOutput, CompletionOutput
    from radixkv.engine.sampling_params import SamplingParams
    from radixkv.engine.llm import LLM

Nothing is imported here, so `import radixkv.engine.<module>` stays as light as that module.
"""
