"""Offline conversion of whole checkpoints, Hugging Face folder <-> converted Megatron checkpoint, above the
learner (its weight I/O lives in :mod:`gspo_mcore.learner.hf`).

- :mod:`~gspo_mcore.convert.convert`: :func:`~gspo_mcore.convert.convert.hf_to_mcore` and
  :func:`~gspo_mcore.convert.convert.mcore_to_hf`, on this process's ranks.
- :mod:`~gspo_mcore.convert.mcore_checkpoint`: the converted Megatron checkpoint (``dist_checkpointing``).
- :mod:`~gspo_mcore.convert.export_source`: which checkpoint of a run folder to export, and its config.
- :mod:`~gspo_mcore.convert.launch`: the command-line tools' launcher (``torchrun`` when a layout needs ranks).
- ``tools/convert_hf_to_mcore.py`` / ``tools/convert_mcore_to_hf.py``: the command-line converters.

Importing this package does not import megatron; the functions do.
"""
