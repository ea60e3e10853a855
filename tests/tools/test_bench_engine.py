"""tools/bench_engine.py --quick runs end to end (a subprocess: it initialises torch.distributed) and writes
the documented JSON: a header naming the machine and model, and one record per engine and length."""

import json
import os
import subprocess
import sys

import pytest
from helpers.launch import run_tool

pytestmark = pytest.mark.distributed  # spawns training processes: not in the fast tier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_engine_quick_writes_the_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_tool(["tools/bench_engine.py", "--quick", "--threads", "1", "--repeat", "2", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "kv / transformers" in proc.stdout
    data = json.loads(out.read_text())
    header = data["header"]
    for key in ("cpu", "isa", "threads", "load_avg", "model", "batch", "kv_vs_transformers_max_abs_logprob_diff"):
        assert key in header, key
    assert header["threads"] == 1
    assert header["kv_vs_transformers_max_abs_logprob_diff"] < 1e-4  # the same weights in both
    runs = {(r["engine"], r["new_tokens"]) for r in data["results"]}
    assert runs == {(e, n) for e in ("kv", "recompute", "transformers") for n in (4, 8)}
    assert header["repeat"] == 2
    for r in data["results"]:
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0 and r["ms_per_step"] > 0
        assert len(r["seconds_all"]) == 2 and r["seconds"] == min(r["seconds_all"])  # the fastest of the runs


def test_bench_engine_refuses_a_repeat_below_one():
    proc = subprocess.run(
        [sys.executable, "tools/bench_engine.py", "--quick", "--repeat", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "--repeat must be >= 1, got 0" in proc.stderr


def test_bench_engine_turns_writes_the_episode_rows(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_tool(
        ["tools/bench_engine.py", "--quick", "--threads", "1", "--engines", "kv"]
        + ["--turns", "2", "--env-tokens", "3", "--json", str(out)]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in json.loads(out.read_text())["results"] if r["engine"] == "kv-turns"]
    assert [(r["new_tokens"], r["total_new_tokens"]) for r in rows] == [(4, 7), (8, 11)]
    for r in rows:
        assert (
            r["seconds"] > 0 and r["single_turn_seconds"] > 0 and r["ratio"] == r["seconds"] / r["single_turn_seconds"]
        )


def test_bench_engine_shared_and_unshared_prefill_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_tool(
        ["tools/bench_engine.py", "--quick", "--threads", "1", "--engines", "kv", "kv-megatron"]
        + ["--group-size", "3", "--share-prefill", "both", "--json", str(out)]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cpu_isa" in proc.stdout and "batch 8 x 3 samples" in proc.stdout
    data = json.loads(out.read_text())
    header = data["header"]
    assert header["group_size"] == 3 and header["share_prefill"] == "both" and header["cpu_isa"]
    engines = ("kv", "kv-unshared", "kv-megatron", "kv-megatron-unshared")
    assert {(r["engine"], r["new_tokens"]) for r in data["results"]} == {(e, n) for e in engines for n in (4, 8)}
    for r in data["results"]:
        assert r["tokens_per_s"] == pytest.approx(8 * 3 * r["new_tokens"] / r["seconds"])  # every sample's tokens
