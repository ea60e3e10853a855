"""Hugging Face weight I/O of the learner (Qwen3 / Qwen3-MoE / Llama / Qwen2), any TP/PP/EP/DP layout.

- :mod:`.mapping`: the one name/layout map between Megatron parameters and Hugging Face tensors (pure torch,
  both directions).
- :mod:`.folder`: a Hugging Face folder on disk: read its config and safetensors lazily, write safetensors, copy
  the side files.
- :mod:`.sharding`: this rank's parameters under global names, and where each is split.
- :mod:`.load`: :func:`~.load.load_hf_weights` fills a sharded model from a Hugging Face folder (each rank
  slices its shard).
- :mod:`.export`: :func:`~.export.hf_buckets` gathers a sharded model into full Hugging Face tensors, in
  byte-bounded buckets, identical on every rank (the rollout weight sync and the Megatron -> HF converter).

Import from the modules. Importing this package does not import megatron; the functions do.
"""
