"""The frozen reference policy of the KL term: the initial weights, kept on the CPU and swapped in for a
forward-only pass.

A second model would double the learner's parameter *and* activation set-up; instead this keeps a copy of
this rank's parameter shards (what the forward reads: the model's own parameters, in their dtype) in CPU
memory, and for the reference forward copies the current parameters aside, copies the reference in, runs
:func:`~gspo_mcore.learner.forward.forward_logprobs` through the same schedule, layout and micro-batching, and
copies the current parameters back (exactly: copies, no arithmetic). Memory: one extra copy of this rank's
parameters in CPU memory for the whole run (:attr:`ReferencePolicy.nbytes`), plus one transient copy during
the swap. Gradients, optimizer state (fp32 master weights) and buffers are not touched.
"""

from __future__ import annotations

import torch


class ReferencePolicy:
    """Snapshot of ``model``'s parameters now (build it before any update, and before a checkpoint is
    restored: the reference is the run's initial policy, rebuilt the same way on resume). Its forwards run on
    ``layout`` with the keywords of :func:`~gspo_mcore.learner.forward.forward_logprobs` (the training's
    micro-batching, temperature and LM-head keys: ``StepSettings.forward_options()``)."""

    def __init__(
        self,
        model,
        layout,
        *,
        max_tokens: int,
        packing: str = "padded",
        temperature: float = 1.0,
        loss_cfg=None,
        share_prompt: bool = False,
    ):
        self.model = model
        self.layout = layout
        self.options = dict(
            max_tokens=max_tokens,
            packing=packing,
            temperature=temperature,
            loss_cfg=loss_cfg,
            share_prompt=share_prompt,
        )
        self._state = [p.detach().to("cpu", copy=True) for p in _params(model)]

    @property
    def nbytes(self) -> int:
        """CPU bytes the snapshot holds."""
        return sum(t.numel() * t.element_size() for t in self._state)

    @torch.no_grad()
    def logprobs(self, samples) -> list[torch.Tensor]:
        """:func:`~gspo_mcore.learner.forward.forward_logprobs` of ``samples`` under the reference weights."""
        from gspo_mcore.learner.forward import forward_logprobs

        params = _params(self.model)
        if len(params) != len(self._state):
            raise ValueError(f"the reference holds {len(self._state)} parameters, the model {len(params)}")
        current = [p.detach().to("cpu", copy=True) for p in params]
        try:
            for p, ref in zip(params, self._state):
                p.copy_(ref)
            return forward_logprobs(self.model, samples, self.layout, **self.options)
        finally:
            for p, cur in zip(params, current):
                p.copy_(cur)


def _params(model) -> list[torch.Tensor]:
    return [p for chunk in model for p in chunk.parameters()]
