"""R3 against real SGLang: the experts SGLang routed each token to, replayed by the learner.

A real SGLang 0.5.23 server (``--enable-return-routed-experts``) serves the tiny random Qwen3-MoE (2 layers,
4 experts, top-2). The learner (Megatron, 1 gloo rank, ``r3_worker.py``) loads the same weights, gets the
samples with their routing through the project's client, and measures the fraction of (token, MoE layer)
pairs where its routers choose other experts than SGLang did:

- R3 off (the learner's own routers): 0 on the weights SGLang served (the same float32 model routes the same
  way), and far from 0 after one optimizer update of the learner (the server keeps the rollout weights);
- R3 on (``replay_routing``, hooked routers): exactly 0 in the old-log-prob forward and in a training forward,
  before and after the update, over every position SGLang routed (prompt from prefill included).

Over multi-turn episodes (``r3_episodes_worker.py``), each sample's last-turn routing covers the whole episode
(prompt, every policy turn, every environment span from its prefill), and it agrees with the learner in the same way.

SGLang on a CPU needs one test-only fix to return routed experts (``sgl_kernel_cpu/sitecustomize.py``: its
host buffer is pinned with ``cudaHostRegister``); the capture itself is SGLang's own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
from sglang_cpu import CPU_ARGS, HERE, PROMPTS, ROOT, launch, learner_env, server_config, write_tiny_checkpoint

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, request):
    ckpt = write_tiny_checkpoint(str(tmp_path_factory.mktemp("sglang_moe") / "base"), moe=True)
    log_dir = str(tmp_path_factory.mktemp("sglang_moe_logs"))
    cfg = dataclasses.replace(server_config(ckpt, log_dir), extra_args=(*CPU_ARGS, "--enable-return-routed-experts"))
    procs, seconds = launch([cfg], log_dir)
    request.config._sglang_figures["MoE server (routed experts) start to healthy (s)"] = seconds
    yield ckpt, procs[0]
    procs[0].shutdown()


@pytest.fixture(scope="module")
def report(moe_server, tmp_path_factory):
    ckpt, proc = moe_server
    out = tmp_path_factory.mktemp("r3")
    spec = {
        "hf_dir": ckpt,
        "urls": [proc.url],
        "lr": 0.05,
        "n": 4,
        "prompts": PROMPTS,
        "params": {"temperature": 1.0, "max_new_tokens": 24},
    }
    (out / "spec.json").write_text(json.dumps(spec))
    env = learner_env()
    t0 = time.monotonic()
    cmd = [sys.executable, os.path.join(HERE, "r3_worker.py"), str(out / "spec.json"), str(out / "report.json")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        pytest.fail(
            f"r3_worker failed ({done.returncode})\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}\n{proc.log_tail()}"
        )
    rep = json.loads((out / "report.json").read_text())
    rep["wall_s"] = time.monotonic() - t0
    return rep


def test_sglang_returns_a_routing_for_every_position_but_the_last(report):
    assert report["num_samples"] == 4 * len(PROMPTS)
    assert report["engine_rows_checked"]


def test_without_replay_the_learner_routes_like_sglang_until_it_updates(report, figures):
    figures("R3 off: disagreement on the served weights", report["before_free"])
    figures("R3 off: disagreement after one update (lr 0.05)", report["after_free"])
    assert report["before_free"] == 0.0, "the same float32 weights must route the same way"
    assert report["before_logprob_maxdiff_free"] < 1.5e-5  # the tier's parity bound (sglang_cpu.LOGPROB_TOL)
    assert report["after_free"] > 0.05, "an update at lr 0.05 must move the routing, or R3 is not tested"


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("forward", ["logprobs", "train"])
def test_with_replay_every_position_goes_to_sglangs_experts(report, figures, when, forward):
    got = report[f"{when}_replayed_{forward}"]
    figures(f"R3 on: disagreement, {forward} forward, {when} the update", got["all"])
    figures("R3: (token, MoE layer) pairs compared", got["pairs"])
    assert got["pairs"] > 0
    assert got["all"] == 0.0 and got["scored"] == 0.0


def test_the_trainer_step_replays_and_reports_the_disagreement(report):
    first = report["train_step"][0]
    assert first["routing_rollout_disagreement"] == pytest.approx(report["after_free"])
    assert all(m["update_successful"] == 1.0 for m in report["train_step"])


# ------------------------------------------------------------------------ R3 over multi-turn episodes
EPISODE_TURNS = 3


@pytest.fixture(scope="module")
def episodes_report(moe_server, tmp_path_factory):
    """3-turn episodes of the echo environment on the MoE server with routed experts asked for
    (``r3_episodes_worker.py``): each turn continues from ``input_ids`` (the radix cache serves the prefix), and the
    sample keeps the last turn's routing, which must cover the whole episode, environment spans included."""
    ckpt, proc = moe_server
    out = tmp_path_factory.mktemp("r3_episodes")
    spec = {
        "hf_dir": ckpt,
        "urls": [proc.url],
        "lr": 0.05,
        "n": 2,
        "turns": EPISODE_TURNS,
        "rows": ["rev:407>", "add:3+4=", "hello world:"],
        "params": {"temperature": 1.0, "max_new_tokens": 8, "seed": 5},
    }
    (out / "spec.json").write_text(json.dumps(spec))
    worker = os.path.join(HERE, "r3_episodes_worker.py")
    cmd = [sys.executable, worker, str(out / "spec.json"), str(out / "report.json")]
    done = subprocess.run(cmd, cwd=ROOT, env=learner_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        pytest.fail(
            f"r3_episodes_worker failed ({done.returncode})\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}\n"
            f"{proc.log_tail()}"
        )
    return json.loads((out / "report.json").read_text())


def test_episode_routing_covers_every_position_sglang_computed(episodes_report, figures):
    samples = episodes_report["samples"]
    assert len(samples) == 3 * 2
    figures("R3 episodes: routed rows checked (all samples)", sum(s["rows"] for s in samples))
    figures("R3 episodes: environment-span rows checked", sum(s["env_rows"] for s in samples))
    for k, s in enumerate(samples):
        assert s["turns"] == EPISODE_TURNS and s["env_rows"] > 0, (k, s)
        # one row per position of prompt + every policy turn + every environment span; only the last is unrouted
        assert s["rows"] == s["length"] and s["last_row_unrouted"] and s["routed_rows_valid"], (k, s)
        # the radix cache kept the routing of the request that computed each prefix position
        assert all(s["earlier_turns_agree"]), (k, s)


@pytest.mark.parametrize("when", ["before", "after"])
def test_episode_routing_replayed_matches_sglang(episodes_report, figures, when):
    rep = episodes_report
    replayed, env = rep[f"{when}_replayed"], rep[f"{when}_replayed_env"]
    figures(f"R3 episodes: replayed disagreement {when} the update, all positions", replayed["all"])
    figures(f"R3 episodes: replayed disagreement {when} the update, environment spans", env)
    figures(f"R3 episodes: free disagreement {when} the update", rep[f"{when}_free"]["all"])
    figures(f"R3 episodes: max |logp diff| replayed, {when}", rep[f"{when}_logprob_maxdiff_replayed"])
    assert replayed["pairs"] > 0
    assert replayed["all"] == 0.0 and replayed["scored"] == 0.0 and env == 0.0
    if when == "before":  # the served weights: the learner's own routers agree with SGLang everywhere
        assert rep["before_free"]["all"] == 0.0 and rep["before_free_env"] == 0.0
        assert rep["before_logprob_maxdiff_replayed"] < 1.5e-5  # sglang_cpu.LOGPROB_TOL
        assert rep["before_logprob_maxdiff_free"] < 1.5e-5
    else:  # the update moved the learner's routing; replay keeps SGLang's
        assert rep["after_free"]["all"] > 0.05
