"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over paged KV, and their HF loader.

    from radixkv.models.config import load_model_config
    from radixkv.models.loader import load_model
"""
