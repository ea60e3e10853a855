"""gspo_mcore/trainer/episode_log.py: the first few error causes of a step are logged one line each, every
episode's end and cause goes to episodes.jsonl, a resumed run drops the lines it writes again, and a rank
without the run folder writes nothing."""

import json

from gspo_mcore.rollout.turns import EpisodeStats
from gspo_mcore.rollout.types import Sample
from gspo_mcore.trainer import episode_log


def _sample(k, end="done", error=None):
    episode = EpisodeStats(turns=2, end=end, error=error, tool_calls=1, env_reward=0.5)
    return _plain(k // 4, k % 4, episode=episode)


def _plain(prompt, sample, **kw):
    return Sample(
        prompt_index=prompt,
        sample_index=sample,
        prompt_ids=(1,),
        response_ids=(2,),
        response_logprobs=(0.0,),
        finish_reason="stop",
        weight_version=0,
        **kw,
    )


def _groups(errors):
    samples = [_sample(k, "error", f"AgentRequestError: message {k} (user) differs\nin content") for k in range(errors)]
    samples += [_sample(k) for k in range(errors, 8)] + [_sample(8, "error", "timeout")]
    return [samples[k : k + 3] for k in range(0, 9, 3)]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_error_causes_are_logged_and_every_episode_is_written(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="gspo_mcore.trainer.episode_log"):
        episode_log.record(_groups(7), 3, str(tmp_path))
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 6, logged  # five causes, then how many more and where they are
    assert (
        logged[0]
        == "step 3: episode (prompt 0, sample 0) ended by AgentRequestError: message 0 (user) differs in content"
    )
    assert "3 more episodes ended by an error" in logged[5] and "episodes.jsonl" in logged[5]
    lines = _lines(tmp_path / "episodes.jsonl")
    assert len(lines) == 9 and all(line["step"] == 3 for line in lines)
    assert lines[0]["cause"] == "AgentRequestError" and lines[0]["message"].endswith("differs\nin content")
    assert lines[7]["end"] == "done" and lines[7]["cause"] is None
    assert (lines[8]["end"], lines[8]["cause"], lines[8]["message"]) == ("error", "timeout", "")
    assert lines[0]["turns"] == 2 and lines[0]["env_reward"] == 0.5


def test_a_resumed_run_drops_the_lines_it_writes_again(tmp_path, monkeypatch):
    for step in range(3):
        episode_log.record(_groups(0), step, str(tmp_path))
    monkeypatch.setattr(episode_log, "_started", set())  # a new process resumes from step 1
    episode_log.record(_groups(1), 1, str(tmp_path))
    assert [line["step"] for line in _lines(tmp_path / "episodes.jsonl")] == [0] * 9 + [1] * 9


def test_no_run_folder_or_no_episodes_writes_nothing(tmp_path):
    episode_log.record(_groups(2), 0, None)
    plain = [[_plain(0, 0)]]
    episode_log.record(plain, 0, str(tmp_path))
    assert not (tmp_path / "episodes.jsonl").exists()
