"""From the ``reward:`` section to callable rewards that know what they need.

A ``Reward`` is a reward function bound to its configuration, with the metadata fields it reads, an
optional per-row check (run on every dataset row at start-up) and the sandbox it runs code in.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from gspo_mcore.config import ConfigError, from_dict, to_dict
from gspo_mcore.rewards import registry
from gspo_mcore.rewards.config import RewardRunnerConfig, RewardTermConfig
from gspo_mcore.sandbox import SandboxConfig


class RewardError(RuntimeError):
    """Base of the errors that stop a run because its rewards cannot be trusted."""


class RewardSetupError(RewardError):
    """A reward cannot run on this configuration, host or dataset (raised at start-up)."""


@dataclass(frozen=True)
class Reward:
    name: str
    """Name in the metrics and messages."""
    spec: str
    """What the config named (``math``, ``pkg.mod:fn``)."""
    where: str
    """The config key that named it (``reward.terms[1].reward``)."""
    fn: Callable[[str, Mapping[str, Any]], float]
    weight: float = 1.0
    required_fields: tuple[str, ...] = ()
    check_row: Callable[[Mapping[str, Any]], None] | None = None
    """Raises for a row this reward cannot score (e.g. malformed tests)."""
    sandbox: SandboxConfig | None = None
    """The sandbox it runs model-written code in (checked at start-up)."""


def default_terms(config: RewardRunnerConfig) -> list[Reward]:
    """The rewards every sample gets (unless its metadata names its own)."""
    if not config.terms:
        return [
            resolve(
                config.reward,
                config,
                name=short_name(config.reward),
                where="reward.reward",
                required_fields=config.required_fields,
            )
        ]
    return [
        resolve(t.reward, config, name=t.name, where=f"reward.terms[{k}].reward", term=t)
        for k, t in enumerate(config.terms)
    ]


def short_name(spec: str) -> str:
    """``pkg.mod:fn`` -> ``fn``; a registered name stays as it is."""
    return spec.replace(":", ".").rsplit(".", 1)[-1]


def resolve(
    spec: str,
    config: RewardRunnerConfig,
    *,
    name: str,
    where: str,
    term: RewardTermConfig | None = None,
    required_fields: tuple[str, ...] = (),
) -> Reward:
    """Bind ``spec`` to its section of ``config`` (and the term's options); ``RewardSetupError`` if it cannot."""
    try:
        fn = registry.get(spec)
    except (KeyError, ImportError, AttributeError, TypeError, ValueError) as e:
        raise RewardSetupError(f"{where} = {spec!r}: {_message(e)}") from e
    options = dict(term.options) if term is not None else {}
    weight = term.weight if term is not None else 1.0
    required = tuple(required_fields) + (term.required_fields if term is not None else ())
    builtin = _builtin_of(fn)
    if builtin is None:
        if options:
            fn = functools.partial(fn, **options)
        declared = tuple(getattr(fn, "required_fields", ()))
        return Reward(name, spec, where, fn, weight, tuple(dict.fromkeys(required + declared)))
    section, bind = builtin
    cfg = getattr(config, section)
    if options:
        try:
            cfg = from_dict(type(cfg), {**to_dict(cfg), **options}, path=f"{where.rsplit('.', 1)[0]}.options")
        except ConfigError as e:
            raise RewardSetupError(str(e)) from e
    return dataclasses.replace(
        bind(cfg),
        name=name,
        spec=spec,
        where=where,
        weight=weight,
        required_fields=tuple(dict.fromkeys(required + bind(cfg).required_fields)),
    )


def _builtin_of(fn):
    from gspo_mcore.rewards.code import check_code_metadata, code_reward
    from gspo_mcore.rewards.match import exact_match, regex_match
    from gspo_mcore.rewards.math import math_reward

    def math_(c):
        return Reward("", "", "", functools.partial(math_reward, config=c), required_fields=(c.answer_key,))

    def exact_(c):
        return Reward("", "", "", functools.partial(exact_match, config=c), required_fields=(c.answer_key,))

    def regex_(c):
        return Reward(
            "", "", "", functools.partial(regex_match, config=c), required_fields=() if c.patterns else (c.pattern_key,)
        )

    def code_(c):
        return Reward(
            "",
            "",
            "",
            functools.partial(code_reward, config=c),
            required_fields=(c.tests_key,),
            check_row=functools.partial(check_code_metadata, config=c),
            sandbox=c.sandbox,
        )

    table = {
        math_reward: ("math", math_),
        exact_match: ("exact", exact_),
        regex_match: ("regex", regex_),
        code_reward: ("code", code_),
    }
    return table.get(fn)


def _message(e: BaseException) -> str:
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
