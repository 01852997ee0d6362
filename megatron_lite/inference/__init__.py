"""Inference: autoregressive generation with a KV cache (generation.py), its sampling flags (sampling_params.py)."""
