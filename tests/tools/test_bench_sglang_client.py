"""tools/bench_sglang_client.py runs: two trees against a stand-in SGLang server (tests/rollout/sglang_standin.py, NOT
SGLang), every request answered, the figures printed and written."""

from __future__ import annotations

import json
import os
import sys

from helpers.launch import ROOT, run_tool

sys.path.insert(0, os.path.join(ROOT, "tests", "rollout"))
from sglang_standin import StandIn  # noqa: E402


def test_bench_sglang_client_drives_the_server_and_reports(tmp_path):
    server = StandIn()
    server.start()
    out = tmp_path / "figures.json"
    try:
        proc = run_tool(
            ["tools/bench_sglang_client.py", "--url", server.url, "--tree", f"a={ROOT}", "--tree", f"b={ROOT}"]
            + ["--requests", "12", "--concurrency", "4", "--rounds", "2", "--json", str(out)],
            timeout=300,
        )
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert server.generate_served == 2 * 2 * 12  # trees x rounds x requests, each one sent
    figures = json.loads(out.read_text())["trees"]
    assert set(figures) == {"a", "b"}
    for f in figures.values():
        assert f["errors"] == 0 and f["requests_per_s"] > 0 and 0 < f["p50_ms"] <= f["p99_ms"]
    assert "req/s" in proc.stdout and "p99 ms" in proc.stdout


def test_bench_sglang_client_refuses_a_tree_without_the_client(tmp_path):
    proc = run_tool(["tools/bench_sglang_client.py", "--url", "http://127.0.0.1:1", "--tree", f"x={tmp_path}"])
    assert proc.returncode == 2 and "gspo_mcore/rollout/_http.py" in proc.stderr


def test_bench_sglang_client_times_rollouts_through_each_trees_engine(tmp_path):
    server = StandIn()
    server.start()
    try:
        # the warm-up's requests (one prompt, one sample or episode); per rollout: requests (a group's n samples are
        # one request; an episode's turn is one) and at most these sampled tokens (the stand-in may end a turn early)
        for kind, warm, requests, tokens in (("group", 1, 3, 3 * 2 * 3), ("episodes", 2, 3 * 2 * 2, 3 * 2 * 2 * 3)):
            out = tmp_path / f"{kind}.json"
            before = server.generate_served
            proc = run_tool(
                ["tools/bench_sglang_client.py", "--url", server.url, "--tree", f"a={ROOT}", "--tree", f"b={ROOT}"]
                + ["--rollout", kind, "--prompts", "3", "--n", "2", "--turns", "2", "--max-new-tokens", "3"]
                + ["--rounds", "2", "--rollouts", "2", "--json", str(out)],
                timeout=300,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            # trees x rounds x (the warm-up + timed rollouts x their requests)
            assert server.generate_served - before == 2 * 2 * (warm + 2 * requests), kind
            figures = json.loads(out.read_text())["trees"]
            for f in figures.values():
                assert len(f["rollout_s"]) == 4 and 0 < f["rollout_s_min"] <= f["rollout_s_median"]
                assert 0 < f["tokens_per_rollout"] <= tokens and f["tokens_per_s"] > 0
            assert "median s" in proc.stdout and f"rollout {kind}" in proc.stdout
    finally:
        server.stop()
