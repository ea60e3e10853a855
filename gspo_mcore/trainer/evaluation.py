"""Evaluation on held-out datasets during training: pass@k, mean reward, response length, truncation.

Each evaluation samples ``n`` responses per held-out prompt with its own sampling parameters and seed
(the same seed at every evaluation; nothing is drawn from the training data stream or its seeds), scores
them with the set's reward, and reports per set, under ``eval/<name>/``:

- ``reward_mean``, ``pass@k`` for each configured ``k`` (a sample passes when its reward is at least
  ``pass_threshold``), ``pass@1_stderr`` (the standard error of pass@1 over the prompts),
  ``response_length_mean``, ``truncated_fraction`` (responses cut at ``max_new_tokens``), ``num_prompts``;
- for a reward of several ``terms``, each term's mean, ``reward/<term>/mean`` (a term of weight 0 is
  measured without changing the reward: e.g. a format check beside correctness);
- under ``rollout.env`` (multi-turn episodes), the training step's episode figures (``episode_tool_use_fraction``,
  ``episode_turns_mean``, ...; :func:`gspo_mcore.trainer.batch.episode_metrics`), and in the samples file each
  episode's turns, tool calls and errors, how it ended and its whole ``transcript``;
- with ``greedy`` and a sampled evaluation (``n > 1`` or temperature > 0): ``greedy_pass@1`` and
  ``greedy_reward_mean`` (and ``greedy_reward/<term>/mean``) from one greedy response per prompt.

pass@k is the unbiased estimator of Chen et al. (2021), ``1 - C(n - c, k) / C(n, k)`` per prompt with
``c`` passing samples out of ``n``, averaged over the prompts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from math import comb

import torch

from gspo_mcore.trainer.backends import RolloutBackend
from gspo_mcore.trainer.batch import decode_responses, episode_metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` draws without replacement from ``n`` samples, ``c`` of them
    passing, passes: ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One held-out set, ready to run: its name, encoded prompts, their metadata and its reward runner."""

    name: str
    prompts: list[list[int]]
    metadata: list
    rewards: object
    rows: list | None = None
    """The dataset rows (``PromptSample``), for a multi-turn backend whose environment resets from them."""


def summarize(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    *,
    n: int,
    pass_k: Sequence[int],
    threshold: float,
) -> dict[str, float]:
    """Metrics of one evaluation: ``rewards``, ``lengths``, ``truncated`` are ``(num_prompts * n,)``, prompt-major."""
    passed = (rewards >= threshold).view(-1, n).sum(dim=1).tolist()  # (num_prompts,) passing samples
    out = {
        "reward_mean": float(rewards.mean()),
        "response_length_mean": float(lengths.float().mean()),
        "truncated_fraction": float(truncated.float().mean()),
        "num_prompts": float(len(passed)),
    }
    for k in pass_k:
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in passed) / len(passed)
    # The sampling noise of pass@1 over these prompts: the standard error of the mean of the per-prompt pass
    # rates (0 with one prompt). It is the spread another draw of the same prompts' samples or of as many
    # prompts from the same set would show, to first order.
    rates = torch.tensor(passed, dtype=torch.float64) / n
    out["pass@1_stderr"] = float(rates.std(correction=1) / len(passed) ** 0.5) if len(passed) > 1 else 0.0
    return out


class Evaluator:
    """Runs the configured evaluations through the training run's rollout backend.

    ``samples_dir``: where each evaluation's responses go, one JSONL file per evaluation
    (``step_<step>.jsonl``: set, kind ``sampled`` / ``greedy``, prompt and sample index, the response text,
    its reward, length and finish reason); ``None`` (ranks other than 0, or ``eval.save_samples: false``):
    not written."""

    def __init__(self, cfg, sets: list[EvalSet], backend: RolloutBackend, tokenizer, samples_dir: str | None = None):
        self.cfg, self.sets, self.backend, self.tokenizer = cfg, sets, backend, tokenizer
        self.samples_dir = samples_dir

    def due(self, step: int) -> bool:
        """Evaluate before ``step``? (The loop also evaluates after its last step.)"""
        return bool(self.sets) and (step == 0 or (self.cfg.every > 0 and step % self.cfg.every == 0))

    def run(self, step: int | None = None) -> dict[str, float]:
        """Every set's metrics, keyed ``eval/<name>/<metric>``; the same on every rank. ``step`` names the
        samples file (none written without it)."""
        out, rows = {}, []
        params = self.cfg.sampling
        sampled = self.cfg.n > 1 or params.temperature > 0
        for s in self.sets:
            m = self._evaluate(s, params, self.cfg.n, rows, "sampled")
            if self.cfg.greedy and sampled:
                greedy = dataclasses.replace(params, temperature=0.0, top_k=-1, top_p=1.0)
                g = self._evaluate(s, greedy, 1, rows, "greedy")
                m["greedy_pass@1"], m["greedy_reward_mean"] = g["pass@1"], g["reward_mean"]
                m.update({f"greedy_{k}": v for k, v in g.items() if k.startswith("reward/")})
            out.update({f"eval/{s.name}/{k}": v for k, v in m.items()})
        if self.samples_dir is not None and step is not None:
            _write_jsonl(os.path.join(self.samples_dir, f"step_{step}.jsonl"), rows)
        return out

    def _evaluate(self, s: EvalSet, params, n: int, rows: list, kind: str) -> dict[str, float]:
        episodes = self.backend.runs_episodes and s.rows is not None  # rollout.env: the same environment
        groups = self.backend.generate(s.rows if episodes else s.prompts, n, params, seed=self.cfg.seed)
        texts = decode_responses(groups, self.tokenizer)
        metas = [meta for meta in s.metadata for _ in range(n)]
        s.rewards.metrics(reset=True)  # count this evaluation's calls only
        ids = [x.response_ids for g in groups for x in g]  # a per-token reward reads them; its terms are unused
        rewards = torch.tensor(s.rewards.score_tokens(texts, metas, ids)[0], dtype=torch.float32)  # (prompts * n,)
        terms = {k: v for k, v in s.rewards.metrics().items() if k.startswith("reward/") and k.endswith("/mean")}
        lengths = torch.tensor([len(x.response_ids) for g in groups for x in g])
        truncated = torch.tensor([x.finish_reason == "length" for g in groups for x in g])
        samples = [x for g in groups for x in g]
        for i, (x, text, r) in enumerate(zip(samples, texts, rewards.tolist())):
            rows.append(
                {
                    "set": s.name,
                    "kind": kind,
                    "prompt_index": i // n,
                    "sample_index": i % n,
                    "response": text,
                    "reward": r,
                    "length": len(x.response_ids),
                    "finish_reason": x.finish_reason,
                    **(_episode_row(x, self.tokenizer) if x.episode is not None else {}),
                }
            )
        pass_k = self.cfg.pass_k if n == self.cfg.n else (1,)
        out = summarize(rewards, lengths, truncated, n=n, pass_k=pass_k, threshold=self.cfg.pass_threshold)
        if len(terms) > 1:  # a reward of several terms: each term's mean (a weight-0 term measures only)
            out.update(terms)
        out.update(episode_metrics(groups, max_error_fraction=1.0))  # multi-turn: tool use etc.; never stops
        return out


def _episode_row(x, tokenizer) -> dict:
    """A multi-turn episode's figures for the samples file, and its whole transcript (every policy and
    environment token, special tokens kept), so that tool calls and results can be read back."""
    e = x.episode
    return {
        "turns": e.turns,
        "tool_calls": e.tool_calls,
        "tool_errors": e.tool_errors,
        "end": e.end,
        "transcript": tokenizer.decode(list(x.response_ids), skip_special_tokens=False),
    }


def _write_jsonl(path: str, rows: list[dict]) -> None:
    """Write ``rows`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
