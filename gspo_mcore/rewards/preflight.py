"""Start-up check of the reward setup: run it before any model is built.

``check_reward_setup`` resolves every configured reward (unknown names and unimportable user
functions fail), probes the sandbox of each reward that runs code (it must provide the isolation its
config requires), and checks every dataset row: the fields each of its rewards declares it needs are
present, and a reward's own row check passes (e.g. the code reward parses the row's tests). It raises
one ``RewardSetupError`` listing the first problems, each naming the reward, the field and the row's
``file:line``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from gspo_mcore.rewards.resolve import RewardSetupError
from gspo_mcore.rewards.runner import RewardRunner, RewardRunnerConfig
from gspo_mcore.sandbox import SandboxUnavailable, startup_check

logger = logging.getLogger(__name__)
_SHOWN = 10


def check_reward_setup(config: RewardRunnerConfig, rows: Iterable[Any], *, check_sandbox: bool = True) -> RewardRunner:
    """Raise ``RewardSetupError`` unless every reward can score every row; returns the ready runner.

    ``rows``: the dataset's samples (``gspo_mcore.data.PromptSample``: ``.source`` is ``path:line`` and
    ``.metadata`` the row's other fields), or ``(source, metadata)`` pairs.
    ``check_sandbox=False`` skips the sandbox probe (tests of the row checks only).
    """
    try:
        runner = RewardRunner(config)
    except RewardSetupError as e:
        raise RewardSetupError(f"reward setup: {e}") from None
    if check_sandbox:
        _check_sandboxes(runner.terms)
    problems, count, sandboxes_checked = [], 0, {id(r.sandbox) for r in runner.terms}
    for source, meta in _pairs(rows):
        try:
            terms = runner.terms_for(meta)
        except RewardSetupError as e:
            problems.append(f"{source}: {e}")
            continue
        if check_sandbox and any(r.sandbox is not None and id(r.sandbox) not in sandboxes_checked for r in terms):
            _check_sandboxes(terms)
            sandboxes_checked |= {id(r.sandbox) for r in terms}
        for r in terms:
            for key in r.required_fields:
                if meta.get(key) is None:
                    problems.append(
                        f"{source}: reward {r.name!r} ({r.spec}, {r.where}) needs metadata field "
                        f"{key!r}, which this row {'lacks' if key not in meta else 'has as null'} "
                        f"(row fields: {sorted(meta)})"
                    )
                    break
            else:
                if r.check_row is not None:
                    try:
                        r.check_row(meta)
                    except Exception as e:  # noqa: BLE001 - any reason the reward could not score this row
                        problems.append(
                            f"{source}: reward {r.name!r} ({r.spec}) cannot score this row: {type(e).__name__}: {e}"
                        )
        count += 1
    if problems:
        shown = "\n  ".join(problems[:_SHOWN])
        more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise RewardSetupError(f"reward setup: {len(problems)} problem(s) in {count} dataset rows:\n  {shown}{more}")
    if count == 0:
        raise RewardSetupError("reward setup: no dataset rows to check")
    return runner


def _check_sandboxes(terms) -> None:
    for r in terms:
        if r.sandbox is None:
            continue
        try:
            layers = startup_check(r.sandbox)
        except SandboxUnavailable as e:
            raise RewardSetupError(
                f"reward {r.name!r} ({r.spec}, {r.where}): the code sandbox is unavailable on this host: {e}"
            ) from None
        logger.info("reward %r: sandbox layers %s", r.name, ", ".join(layers))


def _pairs(rows: Iterable[Any]):
    for k, row in enumerate(rows):
        if hasattr(row, "metadata") and hasattr(row, "source"):
            yield row.source or f"row {k}", row.metadata
        else:
            source, meta = row
            if not isinstance(meta, Mapping):
                raise TypeError(
                    f"check_reward_setup: row {k} ({source}): metadata must be a mapping, got {type(meta).__name__}"
                )
            yield source, meta
