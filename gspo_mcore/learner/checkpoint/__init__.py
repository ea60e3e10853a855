"""Crash-safe training checkpoints: model, optimizer, LR schedule, RNG states, data position, step, config.

One checkpoint is one directory; the model and the optimizer go through Megatron-Core ``dist_checkpointing``
(``torch_dist`` format), so a checkpoint loads into a different TP/PP/EP/DP layout (see "Resharding")::

    <dir>/step_<N>/               the state after (0-based) step N; the loop resumes at N + 1
        megatron/                 model + optimizer (dist_checkpointing: .metadata, *.distcp, common.pt, ...);
                                  with LoRA the adapters and their optimizer state only
        trainer_state.json        step, LR schedule, data position, weight version, layout, optimizer format,
                                  model part (all, or LoRA adapters only)
        rng/rank_<r>.pt           rank r's RNG states (python, numpy, torch CPU/CUDA, Megatron's TP tracker)
        config.yaml               the run's configuration
        manifest.json             written last: every file with its size and sha256, the step, the config hash
    <dir>/latest                  the newest complete checkpoint's name (for people and tools)

Atomicity. Every rank writes into ``step_<N>.tmp-<id>``; after a barrier the files are fsynced and hashed
(each rank a share), rank 0 writes and fsyncs ``manifest.json``, renames the directory to ``step_<N>``
(atomic on POSIX) and fsyncs the parent, then replaces ``latest`` (tmp file + ``os.replace``). A crash
at any point leaves either no ``step_<N>`` or a complete one; leftover ``*.tmp-*`` directories are removed
by the next run. Older checkpoints beyond ``keep_last`` are deleted only after the new one is complete.

Validation on load. A ``step_<N>`` whose manifest is missing or unreadable, or whose files are missing,
truncated or corrupted (size or sha256 mismatch), is rejected with the reason, and resuming falls back to
the previous complete checkpoint. Everything runs on every rank (collectively) so all ranks pick the same.

Resharding. Model tensors and the non-distributed optimizer's state are saved as global tensors and load
into any TP/PP/EP/DP layout. The distributed optimizer's state is saved ``dp_reshardable`` by default
(fast, fully parallel; loads into any DP size but the same TP/PP/EP) or ``fully_reshardable``
(gathered per DP group at save; loads into any layout). Not supported: a MoE layout change that changes
how Megatron splits the optimizer into dense and expert sub-optimizers (e.g. EP2 -> EP1): the model
loads, the optimizer state is refused with a clear error. RNG states are restored only into the same
layout (otherwise the run continues with the freshly seeded generators, and says so).

Test-only hook: ``GSPO_MCORE_TEST_CRASH_IN_SAVE=<step>[:<point>]`` makes rank 0 SIGKILL itself while it
saves checkpoint ``<step>``: ``write`` (default; the shards are written, no manifest yet), ``manifest``
(manifest written, not yet renamed) or ``rename`` (renamed, ``latest`` not yet updated). Never set it
outside tests.

The package: :mod:`.checkpointer` (:class:`CheckpointConfig`, :class:`Checkpointer`: when to save, the
save and resume sequences), :mod:`.files` (the on-disk format: names, manifest, checksums, atomic writes,
validation, retention), :mod:`.megatron_state` (model and optimizer through ``dist_checkpointing``),
:mod:`.rng` (RNG states). Messages go to the logger ``gspo_mcore.learner.checkpoint`` (rank 0 only).
"""

from gspo_mcore.learner.checkpoint.checkpointer import CRASH_ENV, CRASH_POINTS, CheckpointConfig, Checkpointer, Resumed
from gspo_mcore.learner.checkpoint.errors import CheckpointError
from gspo_mcore.learner.checkpoint.files import FORMAT_VERSION, VERIFY_MODES, config_hash, find_latest_valid, validate
from gspo_mcore.learner.checkpoint.megatron_state import OPTIMIZER_FORMATS, load_model_and_optimizer
from gspo_mcore.learner.checkpoint.rng import rng_state, set_rng_state

__all__ = [
    "CRASH_ENV",
    "CRASH_POINTS",
    "FORMAT_VERSION",
    "OPTIMIZER_FORMATS",
    "VERIFY_MODES",
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "Resumed",
    "config_hash",
    "find_latest_valid",
    "load_model_and_optimizer",
    "rng_state",
    "set_rng_state",
    "validate",
]
