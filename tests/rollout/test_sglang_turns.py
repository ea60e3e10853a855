"""The SGLang engine's multi-turn loop (:meth:`SGLangEngine.generate_turns`) and teacher scoring
(:meth:`SGLangEngine.score`) over real sockets against the stand-in server (sglang_standin.py; NOT SGLang: its
tokens are a deterministic function of the request's ``input_ids``, so a test can tell exactly what was sent).
The real-SGLang checks are in tests/integration/test_real_episodes.py and test_real_distill_teacher.py."""

from __future__ import annotations

import asyncio

import pytest
from sglang_standin import expected_response

from gspo_mcore.rollout import SamplingParams, SGLangClientConfig, SGLangEngine
from gspo_mcore.rollout import sglang_api as api
from gspo_mcore.rollout.types import RolloutError

FAST = dict(request_timeout_s=5.0, connect_timeout_s=2.0, max_attempts=2)
PROMPTS = [[5, 6, 7], [9], [11, 12]]


def _engine(server):
    return SGLangEngine([server.url], config=SGLangClientConfig(**FAST))


def test_each_turn_continues_from_the_whole_sequence(standins):
    """Every turn's ``input_ids`` are the prompt, every earlier turn's ids as returned and every environment span
    (so the server's prefix cache can serve them); each turn's budget is ``max_new_tokens`` clipped to what is
    left of ``max_total_tokens``; the rows end when ``on_turns`` answers ``None``."""
    server = standins()
    params = SamplingParams(max_new_tokens=4, seed=1)
    seqs = [list(p) for p in PROMPTS]
    turns = [0] * len(PROMPTS)
    seen = []

    def on_turns(ends):
        answers = []
        for e in ends:
            budget = min(4, 40 - len(seqs[e.row]))
            ids, lps, finish = expected_response(seqs[e.row], 0, budget)
            assert (list(e.ids), list(e.logprobs), e.finish_reason) == (ids, lps, finish), e
            assert e.versions == (0,) * len(ids)
            seqs[e.row] += ids
            turns[e.row] += 1
            seen.append(e.row)
            more = None if turns[e.row] == 3 else [20 + e.row] * (1 + turns[e.row])
            if more is not None:
                seqs[e.row] += more
            answers.append(more)
        return answers

    asyncio.run(_engine(server).generate_turns(PROMPTS, params, keys=[1, 2, 3], max_total_tokens=40, on_turns=on_turns))
    assert turns == [3, 3, 3] and sorted(seen) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    sent = [b["input_ids"] for p, b in server.calls if p == "/generate"]
    assert len(sent) == 9
    for row in range(len(PROMPTS)):  # the last request of each row is its whole sequence but the last turn
        mine = [s for s in sent if s[: len(PROMPTS[row])] == PROMPTS[row]]
        assert max(mine, key=len) == seqs[row][: len(max(mine, key=len))]
    seeds = [b["sampling_params"]["sampling_seed"] for p, b in server.calls if p == "/generate"]
    assert len(set(seeds)) == 9  # one seed per (episode, turn)


def test_a_turn_is_clipped_to_the_room_left(standins):
    server = standins()
    budgets = []

    def on_turns(ends):
        budgets.extend(len(e.ids) for e in ends)
        return [[30] * 3 if len(budgets) == 1 else None for _ in ends]

    asyncio.run(
        _engine(server).generate_turns(
            [[5] * 6], SamplingParams(max_new_tokens=8), keys=[0], max_total_tokens=16, on_turns=on_turns
        )
    )
    sent = [b for p, b in server.calls if p == "/generate"]
    assert [b["sampling_params"]["max_new_tokens"] for b in sent] == [8, 16 - 6 - budgets[0] - 3] == [8, 3]


def test_an_env_span_with_no_room_left_is_an_error(standins):
    server = standins()
    with pytest.raises(RolloutError, match="no room left under max_total_tokens 12"):
        asyncio.run(
            _engine(server).generate_turns(
                [[5] * 6], SamplingParams(max_new_tokens=2), keys=[0], max_total_tokens=12, on_turns=lambda e: [[1] * 9]
            )
        )


def test_score_request_and_answer():
    body = api.build_score_request([4, 5, 6, 7], 2)
    assert body["logprob_start_len"] == 1 and body["sampling_params"]["max_new_tokens"] == 0
    assert body["input_ids"] == [4, 5, 6, 7] and body["return_logprob"] is True
    answer = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.5, 6, None], [-0.25, 7, None]]}}
    assert api.parse_input_logprobs(answer, [4, 5, 6, 7], 2) == (-1.5, -0.25)
    shifted = {"meta_info": {"input_token_logprobs": [[None, 4, None], [-1.5, 5, None], [-0.25, 6, None]]}}
    with pytest.raises(api.ProtocolError, match=r"input_token_logprobs\[0\] is for token 4, position 1 holds 5"):
        api.parse_input_logprobs(shifted, [4, 5, 6, 7], 2)
    # SGLang 0.5.23 echoes ids >= vocab_size - 1 as 0 (the log-prob is still of the id sent)
    clipped = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.5, 6, None], [-0.25, 0, None]]}}
    assert api.parse_input_logprobs(clipped, [4, 5, 6, 63], 2) == (-1.5, -0.25)
    with pytest.raises(api.ProtocolError, match="2 input_token_logprobs for positions 1..3"):
        api.parse_input_logprobs({"meta_info": {"input_token_logprobs": [[None, 5], [-1.0, 6]]}}, [4, 5, 6, 7], 2)
    with pytest.raises(ValueError, match=r"start 0 must be in \[1, 4\)"):
        api.build_score_request([4, 5, 6, 7], 0)


def test_a_rows_cap_shortens_its_turn_below_the_runs_limits(standins):
    """``caps(row)``, asked as each turn starts, is the turn's ``max_new_tokens`` when below the run's limit and
    the room left; above them, they apply."""
    server = standins()
    cap, turns = {0: 3}, []

    def on_turns(ends):
        turns.extend(ends)
        cap[0] = 50  # the next turn's cap: above max_new_tokens and the room left
        return [[30] * 3 if len(turns) == 1 else None for _ in ends]

    asyncio.run(
        _engine(server).generate_turns(
            [[5] * 6], SamplingParams(max_new_tokens=8), keys=[0], max_total_tokens=16, on_turns=on_turns, caps=cap.get
        )
    )
    sent = [b for p, b in server.calls if p == "/generate"]
    assert [b["sampling_params"]["max_new_tokens"] for b in sent] == [3, 16 - 6 - 3 - 3] == [3, 4]
    assert [len(t.ids) for t in turns] == [3, 4] and turns[0].finish_reason == "length"


def test_a_rows_stop_strings_go_to_sglang_as_its_sampling_params_stop(standins):
    """``stops(row)``, asked as each turn starts, is sent as ``sampling_params.stop`` (SGLang ends the turn at the
    token that completes one and keeps it); a turn without stop strings sends none."""
    from gspo_mcore.rollout.turns import TurnStop

    server = standins()
    stop, turns = {0: TurnStop(("END", "\n\n"), lambda ids: False)}, []

    def on_turns(ends):
        turns.extend(ends)
        stop.clear()  # the next turn has none
        return [[30] * 3 if len(turns) == 1 else None for _ in ends]

    asyncio.run(
        _engine(server).generate_turns(
            [[5] * 6],
            SamplingParams(max_new_tokens=4),
            keys=[0],
            max_total_tokens=32,
            on_turns=on_turns,
            stops=stop.get,
        )
    )
    sent = [b["sampling_params"] for p, b in server.calls if p == "/generate"]
    assert [sp.get("stop") for sp in sent] == [["END", "\n\n"], None] and len(turns) == 2
