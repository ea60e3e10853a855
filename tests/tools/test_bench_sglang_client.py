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
