"""A partial rollout against a real SGLang 0.5.23 server: requests still running when the trainer pushes new
weights are paused (``pause_mode: retract``), continued on the new weights, and come back whole, with each
token's weight version (``Sample.token_versions``, from SGLang's ``meta_info.weight_versions`` spans) and
each token's log-prob under the weights that produced it.

The learner (``learner_worker.py``, Megatron on 1 gloo rank) starts long generations, waits until they are
decoding, changes its weights (a stand-in for a training step) and pushes them from disk as version 1
while the generations run, then scores every returned token twice: with the updated learner and, after
putting the old weights back, with the original one. The tokens SGLang reports as version 0 must match
the version-0 learner, those reported as version 1 the version-1 learner, both within the tier's parity
tolerance; each is far from the other version's learner (the negative control: the split is where the
weights really changed, not merely where the spans say so).
"""

from __future__ import annotations

import pytest
from sglang_cpu import LOGPROB_TOL, PROMPTS, get_json

pytestmark = pytest.mark.sglang

LONG = dict(temperature=1.0, max_new_tokens=1200, ignore_eos=True)  # still decoding when the update lands


def test_a_request_spanning_a_weight_update_keeps_each_versions_tokens(server, learner, figures, tmp_path):
    prompts = PROMPTS[:2]
    steps = [
        {"op": "snapshot", "name": "v0"},
        {"op": "start_generate", "name": "spanning", "prompts": prompts, "n": 2, "params": LONG},
        {"op": "wait_running", "at_least": 4, "then_s": 1.0},  # some tokens made on version 0
        {"op": "perturb", "seed": 11, "scale": 0.05},
        {"op": "sync", "method": "disk", "version": 1, "export_dir": str(tmp_path / "export")},
        {"op": "finish_generate", "name": "spanning"},
        {"op": "score", "name": "spanning", "label": "v1"},
        {"op": "restore", "name": "v0"},
        {"op": "score", "name": "spanning", "label": "v0"},
    ]
    server.holds_base = False
    report = learner(
        {"hf_dir": server.base_dir, "urls": [server.url], "pause_mode": "retract", "steps": steps},
        what="partial-rollout",
    )
    samples = [s for g in report["generate"]["spanning"]["groups"] for s in g]
    assert len(samples) == 4
    v0, v1 = report["score"]["v0"], report["score"]["v1"]
    same = {0: [], 1: []}  # |engine - learner of the token's own version|
    other = {0: [], 1: []}  # |engine - learner of the other version|
    for k, s in enumerate(samples):
        where = f"sample {k}"
        assert s["finish_reason"] == "length" and len(s["response_ids"]) == LONG["max_new_tokens"], where
        versions = s["token_versions"]
        assert versions is not None, f"{where}: all its tokens came from one version; the update missed it"
        cut = versions.index(1)
        assert 0 < cut and versions == [0] * cut + [1] * (len(versions) - cut), f"{where}: {versions}"
        assert s["weight_version"] == 0, where  # its staleness is its oldest token's
        for t, ver in enumerate(versions):
            own, alt = (v0, v1) if ver == 0 else (v1, v0)
            same[ver].append(abs(s["response_logprobs"][t] - own["learner"][k][t]))
            other[ver].append(abs(s["response_logprobs"][t] - alt["learner"][k][t]))
        figures("partial rollout: fewest tokens made before the update", cut, worst=min)
        figures("partial rollout: fewest tokens made after the update", len(versions) - cut, worst=min)
    for ver in (0, 1):
        figures(f"partial rollout: version-{ver} tokens, max |sglang - own learner|", max(same[ver]))
        assert max(same[ver]) <= LOGPROB_TOL, (ver, max(same[ver]))
        figures(f"partial rollout: version-{ver} tokens, max |sglang - other learner|", max(other[ver]), worst=min)
        assert max(other[ver]) > 100 * LOGPROB_TOL, (ver, max(other[ver]))
    assert get_json(server.url + "/model_info")["weight_version"] == "1"
