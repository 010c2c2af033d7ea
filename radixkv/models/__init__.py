"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over paged KV, and their loaders: HF
safetensors folders and GGUF files (gguf.py), both named by one MODEL argument (source.py).

    from radixkv.models.config import load_model_config
    from radixkv.models.loader import load_model
"""
