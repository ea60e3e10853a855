"""Adapt Megatron-Core to a CPU-only host (gloo, fp32). The ONLY place the project redirects megatron.

Megatron-Core calls CUDA unconditionally in a few places (``torch.cuda.current_device()``, the CUDA RNG,
streams and events in the MoE dispatcher, ``device="cuda"`` factories, ``torch.cuda.FloatTensor`` checks;
the file:line list for 0.16.1 is in the comments below). On a
host without a usable GPU, :func:`apply` redirects exactly those calls, once, and only for megatron:

1. megatron modules see a ``torch`` whose ``torch.cuda`` is a CPU stand-in (``current_device()`` is the
   CPU, streams/events are no-ops, the "CUDA" RNG is the default CPU generator) and whose tensor
   factories map ``device="cuda"`` to the CPU. The real ``torch`` module is never modified.
2. megatron's CUDA RNG state helpers (``_get_cuda_rng_state``/``_set_cuda_rng_state``) use the CPU
   generator, so ``model_parallel_cuda_manual_seed`` and the RNG tracker's ``fork()`` work.
3. Three functions that demand ``torch.cuda.FloatTensor`` type names or call ``Tensor.cuda()`` run under
   a torch-function mode that reports CPU float tensors by their CUDA names and makes ``.cuda()`` a
   no-op: the distributed optimizer's constructor, fp32 gradient clipping, and the tied-embedding set-up.
4. MoE: 0.16.1 references ``te_general_gemm`` without Transformer Engine (a NameError; fixed in 0.19),
   and the all-to-all token dispatcher needs its split sizes as host arrays, which it only produces for
   CUDA tensors.
5. Context parallelism: the rotary table's CP slice (``get_pos_emb_on_this_cp_rank``) pins and moves an
   index tensor to CUDA; it runs under the same torch-function mode as 3. (The CP core attention itself
   is :mod:`gspo_mcore.platform.cp_attention`, chosen by the learner's model builder.)
6. Checkpoints: the dist_checkpointing modules are redirected like the rest (1.). The distributed
   optimizer here wraps torch's Adam (no Apex/TE), which keeps a per-parameter ``step``; megatron
   restores it from the checkpoint's param groups, then copies the per-parameter states over it: a
   ``dp_reshardable`` load overwrote it with the pre-load (dummy) value, so Adam's bias correction
   restarted (silently wrong updates after a resume), and a ``fully_reshardable`` load failed with
   ``KeyError: 'step'``. Also, the restored ``step`` was ONE tensor shared by every parameter, which
   torch's Adam then increments once per parameter per step. The per-parameter copy now leaves ``step``
   as restored, and each parameter gets its own copy.
7. bf16 (the learner's ``model.options.cpu_bf16``): Megatron's mixed-precision optimizer
   (``Float16OptimizerWithFloat16Params``: fp32 master copies of the bf16 parameters, fp32 Adam state)
   sorts parameters by their CUDA type names, so its constructor runs under the mode of 3. The local layer
   spec's torch norms (``WrappedTorchNorm``) ignore ``params_dtype`` and are built in fp32 (Transformer
   Engine's norms, the GPU path, honour it): the optimizer then holds fp32 and bf16 parameters in one group,
   and its ``sharded_state_dict`` numbers the optimizer's parameters over the bf16 ones only, so a checkpoint
   save failed (``Param id ... does not match any model sharded param``). The norms are built in
   ``params_dtype``, so every parameter is bf16 with an fp32 master copy, as with Transformer Engine.

:func:`apply` is idempotent, a no-op when ``torch.cuda.is_available()``, and warns on a megatron-core
version other than those it was checked on (:data:`CHECKED_VERSIONS`). Everything else the CPU needs
is configuration (fp32, fusions off), chosen by the learner, not patched.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
import warnings

import torch
from torch.overrides import TorchFunctionMode

CHECKED_VERSIONS = ("0.16.1",)
"""megatron-core versions this adapter was checked on (every learner test passed with it)."""

# The megatron modules imported before patching, so that every module on the learner's path sees the
# CPU ``torch`` (modules imported later are patched by a second call to ``apply``).
_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.utils",
    # dist_checkpointing (training checkpoints): the writer's torch.cuda.synchronize(), the savers'
    # device="cuda"/current_device() flags and the load-side exchange buffers
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
)

_applied = False
_patched_modules: set[str] = set()


def is_active() -> bool:
    """Whether the adapter has been applied in this process (never on a host with a usable GPU)."""
    return _applied


def apply() -> bool:
    """Adapt megatron-core to this CPU-only host; returns whether the adapter is active.

    Safe to call any number of times; each call also patches megatron modules imported since the last.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    _quiet_known_cpu_warnings()
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version not in CHECKED_VERSIONS and not _applied:
        warnings.warn(
            f"gspo_mcore.platform.megatron_cpu was checked on megatron-core {CHECKED_VERSIONS}, "
            f"this is {version}: CPU runs may hit CUDA calls it does not redirect",
            stacklevel=2,
        )
    for name in _MODULES:
        importlib.import_module(name)
    _redirect_module_torch()
    if not _applied:
        _patch_rng()
        _patch_cuda_type_checks()
        _patch_moe()
        _patch_distributed_optimizer_load()
        _patch_context_parallel()
        _patch_norm_dtype()
        _applied = True
    return True


# Warnings megatron-core 0.16.1 prints on every CPU-only host, whose content is stated here once: no
# Transformer Engine or Apex (the local layer spec and torch's norms and optimizers are used), a CUDA graph
# option default, and torch's note that it found no CUDA runtime. Silenced only on such a host.
_BENIGN_CPU_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
)


def _quiet_known_cpu_warnings() -> None:
    import logging

    for text in _BENIGN_CPU_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{text}", category=UserWarning)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


# --------------------------------------------------------------------------------------------------
# 1. megatron's view of torch


class _Stream:
    """A CUDA stream/event stand-in: everything runs in order on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _Stream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_DEFAULT_STREAM = _Stream()


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _make_cuda_namespace():
    real = torch.cuda
    ns = types.SimpleNamespace(
        current_device=lambda: torch.device("cpu"),
        device_count=lambda: 0,
        Stream=_Stream,
        Event=_Stream,
        current_stream=lambda *a, **k: _DEFAULT_STREAM,
        default_stream=lambda *a, **k: _DEFAULT_STREAM,
        stream=lambda *a, **k: contextlib.nullcontext(),
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        manual_seed=_cpu_manual_seed,
        manual_seed_all=_cpu_manual_seed,
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        random=types.SimpleNamespace(get_rng_state=lambda *a, **k: torch.get_rng_state()),
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None),
    )

    class _CudaOnCpu(types.SimpleNamespace):
        def __getattr__(self, name):  # everything else: the real torch.cuda
            return getattr(real, name)

    return _CudaOnCpu(**vars(ns))


def _on_cpu(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "randn",
    "rand",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "as_tensor",
)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as megatron sees it on a CPU-only host; every other attribute is the real one."""

    def __getattr__(self, name):
        return getattr(torch, name)


def _make_torch_view():
    view = _TorchOnCpu("torch")
    view.__dict__.update({k: v for k, v in vars(torch).items() if not k.startswith("__")})
    view.cuda = _make_cuda_namespace()
    for name in _FACTORIES:
        setattr(view, name, _cpu_factory(getattr(torch, name)))
    return view


_TORCH_VIEW = None


def _redirect_module_torch():
    global _TORCH_VIEW
    if _TORCH_VIEW is None:
        _TORCH_VIEW = _make_torch_view()
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and name not in _patched_modules and module is not None:
            if getattr(module, "torch", None) is torch:
                module.torch = _TORCH_VIEW
            _patched_modules.add(name)


# --------------------------------------------------------------------------------------------------
# 2. RNG


def _patch_rng():
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


# --------------------------------------------------------------------------------------------------
# 3. CUDA type names and Tensor.cuda()


class _CudaTypeNames(TorchFunctionMode):
    """Report CPU tensors by their CUDA type names and make ``Tensor.cuda()`` a no-op."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaTypeNames():
            return fn(*args, **kwargs)

    return wrapper


def _patch_cuda_type_checks():
    from megatron.core.models.common.language_module import language_module
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    cls = distrib_optimizer.DistributedOptimizer
    cls.__init__ = _with_cuda_type_names(cls.__init__)
    # bf16 on the CPU (the learner's model.options.cpu_bf16): the mixed-precision optimizer sorts the
    # parameters into bf16 ones (given fp32 master copies) and fp32 ones by their CUDA type names
    cls = moptimizer.Float16OptimizerWithFloat16Params
    cls.__init__ = _with_cuda_type_names(cls.__init__)
    wrapped = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped
    moptimizer.clip_grad_by_total_norm_fp32 = wrapped
    lm = language_module.LanguageModule
    lm.setup_embeddings_and_output_layer = _with_cuda_type_names(lm.setup_embeddings_and_output_layer)


# --------------------------------------------------------------------------------------------------
# 4. MoE


def _patch_moe():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def to_host(tensor, as_numpy=False, record_stream=False):
        # On the CPU the split sizes are already on the host; the dispatcher still needs numpy arrays
        # where it asks for them (all_to_all_single takes host split sizes).
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


# --------------------------------------------------------------------------------------------------
# 5. Context parallelism


def _patch_context_parallel():
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    wrapped = _with_cuda_type_names(rope_utils.get_pos_emb_on_this_cp_rank)
    rope_utils.get_pos_emb_on_this_cp_rank = wrapped
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = wrapped


# --------------------------------------------------------------------------------------------------
# 6. Checkpoints


def _patch_distributed_optimizer_load():
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        # torch Adam's per-parameter ``step`` was restored from the param groups: keep it
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return original(self, model_param, {k: v for k, v in tensors.items() if k != "step"})
        finally:
            if step is not None:
                state["step"] = step

    cls._set_main_param_and_optimizer_states = set_states
    original_load = cls.load_state_dict

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for state in self.optimizer.state.values():  # one step counter per parameter, as torch's Adam expects
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    cls.load_state_dict = load_state_dict


# --------------------------------------------------------------------------------------------------
# 7. bf16: the torch norms in params_dtype


def _patch_norm_dtype():
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    original = cls.__new__

    @functools.wraps(original)
    def new(cls_, config, *args, **kwargs):
        norm = original(cls_, config, *args, **kwargs)
        dtype = getattr(config, "params_dtype", torch.float32)
        return norm.to(dtype) if dtype != torch.float32 else norm

    cls.__new__ = staticmethod(new)
