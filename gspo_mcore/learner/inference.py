"""Full-vocabulary logits of the learner's own model, for the in-process rollout engine.

:func:`logits_fn` returns ``tokens [B, L] -> logits [B, L, V]`` (float32 on the CPU), running the live
``GPTModel`` of this rank with a causal mask. Unlike training, the vocabulary-parallel logits ARE
gathered over the tensor-parallel group here: sampling needs the whole distribution, and the engine
handles a few rows at a time. Every rank of the TP group must call it with the same tokens.
Pipeline parallelism is not supported for in-process sampling (use SGLang for PP > 1).
"""

from __future__ import annotations

import torch

from gspo_mcore.learner.model import unwrap
from gspo_mcore.learner.parallel import Layout


def logits_fn(model, layout: Layout):
    """A callable for :class:`gspo_mcore.rollout.InProcessEngine` bound to ``model`` (Megatron's list)."""
    if layout.pp_size > 1:
        raise ValueError(f"in-process sampling needs pipeline parallel size 1, got {layout.pp_size}; "
                         "use the SGLang engine with pipeline parallelism")
    if len(model) != 1:
        raise ValueError("in-process sampling needs a single model chunk (no virtual pipeline stages)")
    gpt = unwrap(model[0])
    pad_multiple = layout.tp_size if gpt.config.sequence_parallel else 1

    @torch.no_grad()
    def fn(tokens: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        B, L = tokens.shape
        width = -(-L // pad_multiple) * pad_multiple  # right padding keeps causal outputs unchanged
        padded = torch.zeros((B, width), dtype=torch.long)
        padded[:, :L] = tokens
        padded = padded.to(layout.device)
        positions = torch.arange(width, device=layout.device).expand(B, width)
        mask = torch.triu(torch.ones(width, width, dtype=torch.bool, device=layout.device), diagonal=1)
        was_training = gpt.training
        gpt.eval()
        try:
            logits = gpt(padded, positions, mask[None, None])  # (B, W, V/TP)
        finally:
            gpt.train(was_training)
        if layout.tp_size > 1:
            logits = gather_from_tensor_model_parallel_region(logits)  # (B, W, V)
        return logits[:, :L].float().cpu()

    return fn
