"""Build the Megatron-Core ``GPTModel`` (Qwen3 / Qwen3-MoE / Llama / Qwen2) for this rank's stage, in Megatron DDP.

The Transformer Engine layer spec is used when ``transformer_engine`` imports on a GPU host, the local
(pure Megatron-Core) spec otherwise. :func:`init_weights` fills the parameters from a seed in a way that
does not depend on the parallel layout (every global tensor is drawn from its own generator, keyed by its
checkpoint name, and this rank copies its shard), so 1 rank, TP, PP, EP and DP runs start identical.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import Literal

import torch

from gspo_mcore.learner.model_config import ModelArch, transformer_config
from gspo_mcore.learner.parallel import ParallelConfig

logger = logging.getLogger(__name__)


def have_transformer_engine() -> bool:
    """Whether the Transformer Engine layer spec can be used (TE importable and a GPU present). On a GPU host
    where the import fails, the reason is logged once: the local spec is then used, which is slower."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"; say which
        _log_te_failure(exc)
        return False
    return True


_te_failure_logged = False


def _log_te_failure(exc: BaseException) -> None:
    global _te_failure_logged
    if _te_failure_logged:
        return
    _te_failure_logged = True
    logger.warning(
        "Transformer Engine does not import (%s: %s): using Megatron-Core's local layer spec", type(exc).__name__, exc
    )


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """How to build the model (the architecture itself comes from ``config.json``)."""

    use_te: bool | None = None
    """Transformer Engine spec: ``None`` picks it when available (GPU + TE), ``False`` forces the local spec."""
    recompute: bool = False
    """Full activation recomputation (saves memory on big models)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32 (Megatron DDP buffers) even for bf16 parameters."""
    cpu_bf16: bool | Literal["auto"] = False
    """On a CPU host, run the model in bf16 as on a GPU (Megatron-Core's mixed precision): bf16 parameters and
    matmuls, fp32 master weights, gradients and Adam state, log-probs computed in fp32 from the bf16 logits;
    the in-process engine then decodes in bf16 too. ``true`` needs a CPU with native bf16 (AVX512_BF16 or
    AMX-BF16) and is refused on any other (emulated bf16 is many times slower than fp32); ``auto``: bf16 where
    the CPU has it, fp32 elsewhere (one logged line says which). No effect on a GPU (always bf16)."""
    cpu_attention: bool = True
    """On a CPU host with the local spec, the core attention is :mod:`gspo_mcore.platform.cpu_attention`:
    Megatron's ``DotProductAttention`` with a forward that keeps scores and probabilities in the model's dtype
    and a hand-written backward (the same results within rounding, 2-3x faster in bf16). ``false``: Megatron's
    own forward. No effect with Transformer Engine, on a GPU, or with context parallelism (its own attention)."""
    cpu_rms_norm: bool = True
    """On a CPU host with the local spec, every RMSNorm runs the compiled kernels of
    :mod:`gspo_mcore.platform.cpu_norm` (forward and backward one pass over each row; torch's backward is about
    ten element-wise ops, 5-6x slower). ``false``: ``torch.nn.RMSNorm`` as Megatron builds it. No effect with
    Transformer Engine or on a GPU."""
    cpu_swiglu: bool = True
    """On a CPU host with the local spec, each MLP's gated activation runs the compiled SwiGLU of
    :mod:`gspo_mcore.platform.cpu_mlp` (one pass forward and one backward instead of chunk, silu, multiply and a
    ``cat``). ``false``: Megatron's MLP forward. No effect with Transformer Engine or on a GPU."""
    cpu_rope: bool = True
    """On a CPU host with the local spec, the attention's rotary embedding runs the compiled kernel of
    :mod:`gspo_mcore.platform.cpu_rope` (one pass over the queries and keys each way, cos and sin taken once per
    forward, float32 inside) where it covers the call. ``false``: Megatron's unfused RoPE. No effect with
    Transformer Engine or on a GPU."""
    cpu_split_linear: bool = True
    """On a CPU host with the local spec, the linear layers' bf16 forward and input-gradient products give each
    thread its own rows (:mod:`gspo_mcore.platform.cpu_linear`) where the output is at most 1024 wide: oneDNN
    leaves threads idle on such shapes (measured 1.6-1.9x faster on 2 threads). ``false``: Megatron's
    ``torch.matmul``. No effect in fp32, with Transformer Engine, on a GPU, or where tensor parallelism all-reduces
    the input gradient."""
    cpu_grad_accumulation: bool = True
    """On a CPU host, each bf16 gradient is added into its float32 ``main_grad`` in one pass
    (:mod:`gspo_mcore.platform.cpu_grad_accumulation`) instead of Megatron's ``main_grad.add_(grad)``, which first
    copies the gradient to float32 (measured about 70 ms of a 1.4 s SmolLM2-135M step on 2 threads), and the word
    embedding's token rows go straight into its ``main_grad`` in float32, without a dense ``[V, H]`` bf16 gradient.
    ``false``: Megatron's. No effect in fp32, on a GPU, or with gradients reduced in bf16."""

    def __post_init__(self):
        if self.use_te and not have_transformer_engine():
            raise ValueError("use_te=True needs a GPU and an importable transformer_engine")
        if self.cpu_bf16 not in (True, False, "auto"):
            raise ValueError(f"model.options.cpu_bf16 must be true, false or auto, got {self.cpu_bf16!r}")
        if self.cpu_bf16 is True and not torch.cuda.is_available():
            from gspo_mcore.platform.cpu_features import BF16_FLAGS, native_bf16

            if not native_bf16():
                raise ValueError(
                    f"model.options.cpu_bf16=true needs a CPU with native bf16 ({' or '.join(BF16_FLAGS)} in "
                    "/proc/cpuinfo); this one has neither, and emulated bf16 is many times slower than fp32: "
                    "set model.options.cpu_bf16: false"
                )

    def bf16(self) -> bool:
        """Whether the model runs in bf16 on this host (always on a GPU; on a CPU with ``cpu_bf16``)."""
        if torch.cuda.is_available() or self.cpu_bf16 is True:
            return True
        if self.cpu_bf16 == "auto":
            from gspo_mcore.platform.cpu_features import native_bf16

            return bool(native_bf16())
        return False


def build_model(
    arch: ModelArch,
    parallel: ParallelConfig,
    options: ModelOptions = ModelOptions(),
    *,
    seed: int | None = 1234,
    use_distributed_optimizer: bool = False,
    wrap_ddp: bool = True,
    lora=None,
):
    """This rank's model chunk, wrapped in Megatron DDP, in a one-element list (Megatron's convention).

    Call after :func:`gspo_mcore.learner.parallel.init_parallel`. ``use_distributed_optimizer`` must match
    the :class:`~gspo_mcore.learner.optimizer.OptimConfig` (the gradient buffers are laid out for it).
    With ``seed`` the weights are filled by :func:`init_weights` (layout independent); ``seed=None`` keeps
    Megatron's own initialisation (e.g. before loading a checkpoint). ``wrap_ddp=False`` returns the bare
    ``GPTModel`` (no gradient buffers: weight conversion, inference). ``lora``: a
    :class:`~gspo_mcore.learner.lora.LoraConfig`; when enabled, the adapters are added and initialised and every
    other parameter is frozen, before the DDP wrap (see :mod:`gspo_mcore.learner.lora`).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    on_gpu = torch.cuda.is_available()
    use_te = have_transformer_engine() if options.use_te is None else options.use_te
    if options.cpu_bf16 == "auto" and not on_gpu:
        from gspo_mcore.platform.cpu_features import native_bf16

        found = native_bf16()
        logger.info(
            "model.options.cpu_bf16=auto: %s",
            f"bf16 (this CPU has {', '.join(found)})" if found else "fp32 (this CPU has no native bf16)",
        )
    config = transformer_config(
        arch,
        tensor=parallel.tensor,
        pipeline=parallel.pipeline,
        expert=parallel.expert,
        expert_tensor=parallel.expert_tensor_size,
        context=parallel.context,
        sequence_parallel=parallel.use_sequence_parallel(arch),
        on_gpu=on_gpu,
        bf16=options.bf16(),
        recompute=options.recompute,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    if not use_te and (parallel.context > 1 or (options.cpu_attention and not on_gpu)):
        from gspo_mcore.platform import cp_attention, cpu_attention

        # CP: the local attention refuses it (a correctness path); otherwise the faster CPU attention
        core = cp_attention.core_attention_class() if parallel.context > 1 else cpu_attention.core_attention_class()
        spec = cpu_attention.with_core_attention(spec, core)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,  # vocabulary-parallel logits: never gathered
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )
    if not use_te and not on_gpu:  # the local spec on a CPU: its element-wise modules run the compiled kernels
        from gspo_mcore.platform import cpu_linear, cpu_mlp, cpu_norm, cpu_rope

        if options.cpu_split_linear:
            cpu_linear.use_split_linear(model)
        if options.cpu_rope:
            cpu_rope.use_compiled_rope(config)
        if options.cpu_rms_norm:
            cpu_norm.use_compiled_rms_norm(model)
        if options.cpu_swiglu:
            cpu_mlp.use_compiled_swiglu(model)
    if arch.is_moe:
        # routers keep their own RouterReplay (gspo_mcore.learner.routing drives them one by one); drop
        # Megatron's process-wide list so that building models repeatedly does not keep old ones alive
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    if seed is not None:
        init_weights(model, seed=seed, std=arch.initializer_range)
    if lora is not None and lora.enabled:
        from gspo_mcore.learner import lora as lora_adapters

        lora_adapters.check_layout(lora, arch=arch, parallel=parallel, use_te=use_te)
        lora_adapters.attach(model, lora)
    if not wrap_ddp:
        return [model]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=options.grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    if options.cpu_grad_accumulation and not on_gpu:
        from gspo_mcore.platform import cpu_grad_accumulation

        cpu_grad_accumulation.use_one_pass_accumulation(ddp)
    return [ddp]


def unwrap(model_chunk):
    """The ``GPTModel`` inside a DDP wrapper."""
    while hasattr(model_chunk, "module"):
        model_chunk = model_chunk.module
    return model_chunk


@torch.no_grad()
def init_weights(model, *, seed: int, std: float = 0.02) -> None:
    """Fill every parameter from ``seed``, identically for any parallel layout.

    Each global tensor (as named in Megatron's sharded state dict, with its global shape: layers and
    experts are leading axes) is drawn from a generator seeded by ``seed`` and the tensor's name; the
    rank copies the slice it holds. Matrices and embeddings get ``N(0, std)``, vectors (norm weights and
    biases) ``1 + N(0, 0.1)`` / ``N(0, 0.1)``. For tests and benchmarks; real runs load checkpoints.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    model = unwrap(model)
    written = {}
    for sh in _flatten(model.sharded_state_dict(), ShardedTensorFactory):
        if not isinstance(sh, ShardedTensor) or not torch.is_tensor(sh.data) or sh.key.endswith("_extra_state"):
            continue
        if not sh.data.is_floating_point():
            continue
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(sh.key.encode())) % (2**63))
        full = torch.randn(sh.global_shape, generator=gen, dtype=torch.float32)
        n_prepend = sh.prepend_axis_num
        if len(sh.global_shape) - n_prepend == 1:
            full = (1.0 if "norm" in sh.key else 0.0) + 0.1 * full
        else:
            full = full * std
        local_shape = tuple(sh.local_shape)
        if len(local_shape) == len(sh.global_shape) - n_prepend:
            local_shape = (1,) * n_prepend + local_shape
        index = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, local_shape))
        local = full[index].reshape(sh.data.shape)
        sh.data.copy_(local.to(sh.data.dtype))
        written[id(sh.data)] = sh.data  # (keeps views alive so that ids stay unique)
    written_storage = {t.untyped_storage().data_ptr() for t in written.values()}
    missed = [n for n, p in model.named_parameters() if p.untyped_storage().data_ptr() not in written_storage]
    if missed:
        raise RuntimeError(f"init_weights: parameters missing from the sharded state dict: {missed}")


def _flatten(tree, factory_type):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _flatten(v, factory_type)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _flatten(v, factory_type)
    elif isinstance(tree, factory_type):
        yield from _flatten(tree.build(), factory_type)
    else:
        yield tree
