"""Asynchronous rollouts (``rollout.max_staleness >= 1``): the first round of step ``s + 1`` is generated
while the learner trains on step ``s``, and samples too old when their step trains are never trained on.

Timeline of step ``s`` (the learner and the engine hold weight version ``s`` as it starts)::

    take the batch prefetched during step s-1 (made on version s-1)   # or generate it now (first step)
    [dynamic sampling: refill rounds, generated now on version s]
    start generating step s+1's first round in the background (version s)
    train on step s                                                      # overlaps that generation
    wait for the background generation; push the weights (version s+1)
    checkpoint: the data position *before* step s+1's prompts were drawn

So a sample trained at step ``s`` is at most one version old, and the weights change only at step
boundaries, when no request is in flight. With ``rollout.partial_rollouts`` the push does not wait: the
servers retract the running requests, load the new weights and continue them, so a response may hold
tokens of versions ``s`` and ``s + 1`` (``Sample.token_versions``; its ``weight_version`` is the
oldest). :func:`fresh_groups` still checks every sample's ``weight_version`` against ``max_staleness``
(a group with a sample older than that is dropped whole and counted), so a stale batch is never trained
on silently.

Resume: the checkpoint of step ``s`` records the loader's position before the in-flight batch of step
``s + 1`` was drawn, so a resumed run draws the same prompts for step ``s + 1`` and regenerates them, with
the same seed, on the checkpoint's weights (version ``s + 1``, one newer than the interrupted run used):
deterministic, nothing lost or duplicated in the prompt stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def fresh_groups(groups: Sequence[Sequence[Any]], *, version: int, max_staleness: int) -> torch.Tensor:
    """``(num_groups,)`` bool: groups whose every sample's ``weight_version`` is at least
    ``version - max_staleness`` (``version``: the weights the learner trains from)."""
    oldest = version - max_staleness
    return torch.tensor([all(s.weight_version >= oldest for s in g) for g in groups], dtype=torch.bool)


@dataclass
class _Pending:
    step: int
    prompts: list
    loader_state: dict
    handle: Any


class Prefetcher:
    """Draws and starts the first round of the next step in the background; hands it to that step.

    ``start_generate(prompt_ids, seed=...)`` must return a handle (a
    :class:`~gspo_mcore.trainer.backends.GenerateHandle`: its ``seconds``) and ``finish_generate(handle)`` the
    groups; every rank calls both in the same order (the backend broadcasts from its driver).
    """

    def __init__(self, loader, start_generate, finish_generate):
        self.loader, self._start, self._finish = loader, start_generate, finish_generate
        self.pending: _Pending | None = None
        self._done: list | None = None
        self.seconds = 0.0
        """How long the last finished background generation ran (its handle's ``seconds``; 0 if unknown)."""

    def start(self, step: int, n: int, *, seed: int) -> None:
        """Draw step ``step``'s first ``n`` prompts and start generating them (nothing when none are left)."""
        if self.pending is not None:
            raise RuntimeError(f"a batch for step {self.pending.step} is already in flight")
        state = self.loader.state_dict()
        prompts = self.loader.next_batch(n)
        handle = self._start([p.input_ids for p in prompts], seed=seed) if prompts else None
        self.pending, self._done = _Pending(step, prompts, state, handle), None

    def wait(self) -> None:
        """Let the in-flight generation finish (before the weights change, unless partial rollouts)."""
        if self.pending is not None and self._done is None:
            self._done = self._finish(self.pending.handle) if self.pending.prompts else []
            self.seconds = (self.pending.handle.seconds if self.pending.prompts else None) or 0.0

    def take(self, step: int) -> tuple[list, list] | None:
        """The prompts and groups prefetched for ``step``, or ``None`` when there are none for it."""
        if self.pending is None:
            return None
        if self.pending.step != step:
            raise RuntimeError(f"the batch in flight is for step {self.pending.step}, not {step}")
        self.wait()
        prompts, groups = self.pending.prompts, self._done
        self.pending, self._done = None, None
        return prompts, groups

    def loader_state(self) -> dict:
        """What a checkpoint saves: the data position before the in-flight batch was drawn."""
        return self.pending.loader_state if self.pending is not None else self.loader.state_dict()
