"""Early stop (gspo_mcore.trainer.early_stop): when each rule fires, the loop stopping there (with its final
evaluation), resume of the tracker, the refused settings, and the no-update warning printed by one rank only."""

import logging
from types import SimpleNamespace

import pytest

from gspo_mcore.train import parse_config
from gspo_mcore.trainer import loop
from gspo_mcore.trainer.early_stop import EarlyStop, EarlyStopConfig

KEY = "eval/heldout/pass@1"


def test_eval_patience_fires_after_k_evaluations_without_a_new_best():
    s = EarlyStop(EarlyStopConfig(eval_patience=2), ["heldout", "other"])
    fired = [s.after_eval({KEY: v}) for v in (0.1, 0.5, 0.5, 0.7, 0.7, 0.6)]
    assert fired == [False, False, False, False, False, True] and "best 0.7000 for 2 evaluations" in s.reason
    assert not EarlyStop(EarlyStopConfig(), ["heldout"]).after_eval({KEY: 0.0})  # off
    assert not EarlyStop(EarlyStopConfig(eval_patience=1), []).after_eval({KEY: 0.0})  # no evaluation set


def test_no_signal_steps_counts_consecutive_steps_only_and_resumes():
    s = EarlyStop(EarlyStopConfig(no_signal_steps=3), [])
    steps = [0.5, 0.0, 0.0, 0.25, 0.0, 0.0]
    assert [s.after_step({"nonzero_advantage_fraction": f}) for f in steps] == [False] * 6
    resumed = EarlyStop(EarlyStopConfig(no_signal_steps=3), [])
    resumed.load_state_dict(s.state_dict())
    assert resumed.after_step({"nonzero_advantage_fraction": 0.0}) and "last 3 steps" in resumed.reason


def _run_loop(monkeypatch, cfg, signal, evals):
    """``loop._train`` with a scripted step (its nonzero-advantage share) and evaluation (pass@1 per call)."""
    steps, evaluated = [], []

    def fake_step(state, step):
        steps.append(step)
        return {"nonzero_advantage_fraction": signal(step)}

    monkeypatch.setattr(loop, "gspo_step", fake_step)
    evaluator = SimpleNamespace(
        sets=[1],
        due=lambda step: step % cfg.eval.every == 0,
        run=lambda step: evaluated.append(step) or {KEY: evals(len(evaluated))},
    )
    metrics = SimpleNamespace(log=lambda *a, **k: None)
    checkpoints = SimpleNamespace(due=lambda step: False, cfg=SimpleNamespace(save_every=0))
    stopper = EarlyStop(cfg.early_stop, [d.name for d in cfg.eval.datasets])
    state = SimpleNamespace(cfg=cfg, stopper=stopper, learner=SimpleNamespace(is_writer=True))
    loop._train(state, evaluator, checkpoints, metrics, 0)
    return steps, evaluated, stopper.reason


EVAL = "eval.datasets=[{name: heldout, data: {paths: [x.jsonl]}}]"


def test_the_loop_stops_when_a_rule_fires_and_still_evaluates_after_its_last_step(monkeypatch):
    cfg = parse_config(["--config", "examples/tiny/config.yaml", "eval.every=5", EVAL])
    assert (cfg.early_stop.eval_patience, cfg.early_stop.no_signal_steps) == (3, 10)  # the demo uses it
    steps, evaluated, reason = _run_loop(monkeypatch, cfg, lambda s: float(s < 7), lambda k: 0.1 * k)
    assert steps == list(range(17)) and evaluated == [0, 5, 10, 15, 17] and "no sample" in reason
    # pass@1 flat from the first evaluation: the 4th evaluation (before step 15) is the 3rd without a new best
    steps, evaluated, reason = _run_loop(monkeypatch, cfg, lambda s: 1.0, lambda k: 0.5)
    assert steps == list(range(15)) and evaluated == [0, 5, 10, 15] and "eval_patience=3" in reason
    off = parse_config(
        [
            "--config",
            "examples/tiny/config.yaml",
            "steps=20",
            "eval.every=5",
            "early_stop.no_signal_steps=0",
            "early_stop.eval_patience=0",
            EVAL,
        ]
    )
    steps, evaluated, reason = _run_loop(monkeypatch, off, lambda s: 0.0, lambda k: 0.5)
    assert steps == list(range(20)) and evaluated == [0, 5, 10, 15, 20] and reason == ""


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["early_stop.no_signal_steps=-1"], "early_stop.no_signal_steps must be an integer >= 0"),
        (["early_stop.eval_set=nope", EVAL], "early_stop.eval_set='nope' is not one of eval.datasets"),
        (["eval.every=0", EVAL], "early_stop.eval_patience=3 needs eval.every > 0"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        parse_config(["--config", "examples/tiny/config.yaml", *overrides])


def test_the_no_update_warning_is_printed_by_one_rank(caplog):
    with caplog.at_level(logging.WARNING, logger=loop.logger.name):
        assert loop._too_few_samples([], 2, 7, warn=False)
        assert not caplog.records
        assert loop._too_few_samples([], 2, 7, warn=True)
        assert len(caplog.records) == 1 and "0 samples to train on" in caplog.records[0].getMessage()
        assert not loop._too_few_samples([1, 2], 2, 7)
