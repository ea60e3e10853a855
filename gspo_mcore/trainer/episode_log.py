"""Why episodes ended, where a user can read it: each step's first few error causes logged (one line each:
the episode, the exception, its message), and every episode's end and cause appended to ``episodes.jsonl`` in
the run folder (one JSON object per episode).

Metrics count errors per exception name only (``episode_env_errors/<cause>``); the messages live here. A run
that resumes from a checkpoint drops the lines of steps at or after the one it resumes with (written by the
attempt that went past the checkpoint), as ``metrics.jsonl`` does.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from gspo_mcore.rollout.types import Sample

FILE = "episodes.jsonl"
LOGGED_PER_STEP = 5
"""How many error causes of one step are logged (all of them are in ``episodes.jsonl``)."""
MESSAGE_CHARS = 400
"""A logged message is cut to this many characters (``episodes.jsonl`` keeps it whole)."""

logger = logging.getLogger(__name__)
_started: set[str] = set()  # files this process already trimmed for a resumed run


def record(groups: Sequence[Sequence[Sample]], step: int, output_dir: str | None) -> None:
    """Log the step's first :data:`LOGGED_PER_STEP` episode errors and append every episode to
    ``output_dir/episodes.jsonl``. ``output_dir`` None (a rank that does not write the run's files) or a batch
    without episodes: nothing."""
    episodes = [s for g in groups for s in g if s.episode is not None]
    if output_dir is None or not episodes:
        return
    errors = [s for s in episodes if s.episode.end == "error"]
    for s in errors[:LOGGED_PER_STEP]:
        cause, message = _cause(s.episode.error)
        message = " ".join(message.split())
        if len(message) > MESSAGE_CHARS:
            message = message[:MESSAGE_CHARS] + "..."
        logger.warning(
            "step %d: episode (prompt %d, sample %d) ended by %s: %s",
            step,
            s.prompt_index,
            s.sample_index,
            cause,
            message,
        )
    if len(errors) > LOGGED_PER_STEP:
        logger.warning(
            "step %d: %d more episodes ended by an error (every cause: %s)",
            step,
            len(errors) - LOGGED_PER_STEP,
            os.path.join(output_dir, FILE),
        )
    path = os.path.join(output_dir, FILE)
    if path not in _started:
        _started.add(path)
        _drop_from(path, step)
    with open(path, "a") as f:
        for s in episodes:
            f.write(json.dumps(_line(s, step)) + "\n")


def _cause(error: str | None) -> tuple[str, str]:
    """``("TimeoutError", "...")`` from ``"TimeoutError: ..."``; a bare cause (``timeout``) has no message."""
    cause, _, message = (error or "unknown").partition(":")
    return cause.strip(), message.strip()


def _line(s: Sample, step: int) -> dict:
    e = s.episode
    cause, message = _cause(e.error) if e.end == "error" else (None, None)
    return {
        "step": step,
        "prompt_index": s.prompt_index,
        "sample_index": s.sample_index,
        "end": e.end,
        "cause": cause,
        "message": message,
        "turns": e.turns,
        "tool_calls": e.tool_calls,
        "tool_errors": e.tool_errors,
        "env_reward": e.env_reward,
        "policy_tokens": e.policy_tokens,
        "env_tokens": e.env_tokens,
        "env_s": round(e.env_s, 6),
    }


def _drop_from(path: str, step: int) -> None:
    """Keep only the lines of steps before ``step`` (a resumed run writes ``step`` again)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", -1) < step]
    if len(kept) != len(lines):
        with open(path, "w") as f:
            f.writelines(kept)
