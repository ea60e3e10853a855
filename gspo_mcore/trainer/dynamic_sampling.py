"""One step's rollout batch, with DAPO's dynamic sampling: roll out rounds of prompts until the step holds
``target`` groups with a reward spread (a non-zero advantage), at most ``max_rounds`` rounds.

Each round draws ``target`` fresh prompts from the loader (DAPO / verl with the generation batch equal to
the training batch), rolls them out and scores them. Groups whose shaped rewards are all equal get no
gradient and are not kept; the first ``target`` kept groups, in the order they were generated, are the
step's training batch, and kept groups beyond them are discarded (their prompts are used up, as in
verl). When the bound is reached, or the prompts run out, with fewer groups kept, the step trains on
those (like ``drop_zero_advantage_groups``): the learner's normaliser counts the sequences or tokens it
is given, so fewer groups only make a smaller batch. verl raises an error there instead; this trainer
warns and reports ``sampling_groups_short`` (the missing groups) in the step's metrics.

Determinism: the prompts come from the loader in stream order and round ``r`` samples with
:func:`rollout_seed` ``(seed, step, r)``, so the prompts a step uses, and the loader's position after it,
are functions of the data, the seeds and the policy. A checkpoint saves the position after the step; a
resumed run continues the same prompt stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gspo_mcore.algo import zero_advantage_groups

Scored = tuple[list, torch.Tensor, torch.Tensor] | tuple[list, torch.Tensor, torch.Tensor, list | None]
"""What rolling out a round gives: its groups, task rewards and shaped rewards (``(num_groups * G,)``), and
optionally the per-token reward terms of each sample (``None`` or a list per sample; see
:meth:`~gspo_mcore.rewards.RewardRunner.score_tokens`)."""


@dataclass(frozen=True)
class RolloutBatch:
    """Every group generated in one step, and which of them the learner trains on."""

    prompts: list
    """The prompts of all rounds, in generation order (one per group)."""
    groups: list
    """Their groups of ``G`` samples."""
    scores: torch.Tensor
    """Task rewards, ``(num_groups * G,)``."""
    shaped: torch.Tensor
    """The rewards the advantages are taken from, ``(num_groups * G,)``."""
    keep: torch.Tensor
    """``(num_groups,)`` bool: the groups trained on."""
    rounds: int
    """Rounds of generation used (1 without dynamic sampling)."""
    short: int
    """Dynamic sampling: groups missing from ``target`` when the rounds or the prompts ran out (else 0)."""
    unusable: int = 0
    """Groups ``usable`` refused (too stale to train on)."""
    token_shaping: list | None = None
    """Per sample of every group (``num_groups * G``), ``None`` or its per-token reward terms; ``None`` when no
    reward returned any."""


def rollout_seed(seed: int, step: int, round_: int) -> int:
    """The base sampling seed of round ``round_`` of ``step``. Round 0 keeps the trainer's historical
    ``seed * 100_003 + step``; later rounds hash ``(seed, step, round)`` to a signed 64-bit seed."""
    if round_ == 0:
        return seed * 100_003 + step
    digest = hashlib.blake2b(f"refill:{seed}:{step}:{round_}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def collect(
    draw: Callable[[int], Sequence],
    roll: Callable[[Sequence, int], Scored],
    *,
    target: int,
    group_size: int,
    dynamic: bool,
    max_rounds: int,
    drop_zero_advantage_groups: bool = False,
    usable: Callable[[list], torch.Tensor] | None = None,
) -> RolloutBatch | None:
    """The step's rollout batch; ``None`` when no prompts are left.

    ``draw(n)``: the next ``n`` prompts (fewer or none when the data runs out); ``roll(prompts, round)``:
    their groups, scores and shaped rewards. Without ``dynamic`` one round is made and every group is
    kept, or, with ``drop_zero_advantage_groups``, those with a reward spread. ``usable(groups)``:
    ``(num_groups,)`` bool, the groups that may be trained on at all (the staleness bound); the others
    are never kept and are counted in ``RolloutBatch.unusable``.
    """
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    prompts, groups, scores, shaped, keep, tokens = [], [], [], [], [], []
    kept, rounds, unusable = 0, 0, 0
    while rounds < (max_rounds if dynamic else 1) and not (dynamic and kept >= target):
        batch = list(draw(target))
        if not batch:
            break
        got, s, sh, *rest = roll(batch, rounds)
        terms = rest[0] if rest else None
        tokens += list(terms) if terms is not None else [None] * s.numel()
        rounds += 1
        if len(got) != len(batch) or s.numel() != len(batch) * group_size or sh.shape != s.shape:
            raise ValueError(
                f"round {rounds - 1}: {len(batch)} prompts gave {len(got)} groups and {s.numel()} rewards "
                f"(group_size {group_size})"
            )
        signal = ~zero_advantage_groups(sh, group_size)  # (len(batch),)
        if usable is not None:
            ok = usable(got)
            unusable += int((~ok).sum())
            signal = signal & ok
        if dynamic:
            room = max(target - kept, 0)
            take = signal & (torch.cumsum(signal.long(), 0) <= room)  # the first `room` groups with signal
        else:
            take = signal if drop_zero_advantage_groups else (ok if usable is not None else torch.ones_like(signal))
        kept += int(take.sum())
        prompts += batch
        groups += list(got)
        scores.append(s)
        shaped.append(sh)
        keep.append(take)
    if not groups:
        return None
    return RolloutBatch(
        prompts=prompts,
        groups=groups,
        scores=torch.cat(scores),
        shaped=torch.cat(shaped),
        keep=torch.cat(keep),
        rounds=rounds,
        short=max(target - kept, 0) if dynamic else 0,
        unusable=unusable,
        token_shaping=tokens if any(t is not None for t in tokens) else None,
    )
