"""Each weight-sync method of the SGLang client against a real SGLang 0.5.23 server.

The learner (Megatron, 1 gloo rank, ``learner_worker.py``) loads the test checkpoint, which the server
also serves; it changes its weights (a stand-in for a training step), gathers them with
:func:`gspo_mcore.learner.hf.export.hf_buckets` and pushes them with one method. Then: the server's generations
change, every sample and the server report the new weight version, and SGLang's log-probs match the
*updated* learner's within the tier's tolerance (``LOGPROB_TOL``, see test_real_generation.py). The
samples drawn before the update, re-scored by the updated learner, are the negative control: their
SGLang log-probs are far from the learner's, so the parity check would catch weights that did not
arrive.

- ``disk``: safetensors written from the buckets, ``/update_weights_from_disk``;
- ``tensor``: the buckets as shared CPU tensors (torch's ``file_system`` strategy; the server is
  colocated) through ``/update_weights_from_tensor`` inside a ``begin/end_weight_update`` session,
  several buckets;
- ``distributed``: ``/init_weights_update_group`` (gloo, on loopback) with the trainer's side of the group
  created as SGLang creates its own, then ``/update_weights_from_distributed`` with the trainer
  broadcasting each tensor, several buckets.
"""

from __future__ import annotations

import pytest
from sglang_cpu import LOGPROB_TOL, PROMPTS, check_samples, get_json

pytestmark = pytest.mark.sglang

GREEDY = dict(temperature=0.0, max_new_tokens=16, ignore_eos=True)
SAMPLED = dict(temperature=1.0, max_new_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("method,version", [("disk", 1), ("tensor", 2), ("distributed", 3)])
def test_weight_sync(method, version, server, learner, figures, tmp_path):
    steps = [
        {"op": "generate", "name": "before_greedy", "prompts": PROMPTS, "n": 1, "params": GREEDY},
        {"op": "generate", "name": "before", "prompts": PROMPTS, "n": 2, "params": SAMPLED},
        {"op": "score", "name": "before"},  # server and learner agree before the change
        {"op": "perturb", "seed": version, "scale": 0.05},
        {
            "op": "sync",
            "method": method,
            "version": version,
            "export_dir": str(tmp_path / "export"),
            "bucket_bytes": 64 * 1024,
        },
        {"op": "generate", "name": "after_greedy", "prompts": PROMPTS, "n": 1, "params": GREEDY},
        {"op": "generate", "name": "after", "prompts": PROMPTS, "n": 2, "params": SAMPLED},
        {"op": "score", "name": "after"},
        {"op": "score", "name": "before", "label": "control"},  # negative control: old samples, new learner
    ]
    server.holds_base = False  # whatever happens below, the next test reloads the checkpoint
    report = learner({"hf_dir": server.base_dir, "urls": [server.url], "steps": steps}, what=f"sync-{method}")

    check_samples(report["generate"]["before"], SAMPLED, 2, PROMPTS, version=0)
    assert report["score"]["before"]["max_abs_diff"] <= LOGPROB_TOL
    check_samples(report["generate"]["after"], SAMPLED, 2, PROMPTS, version=version)
    check_samples(report["generate"]["after_greedy"], GREEDY, 1, PROMPTS, version=version)

    # the weight version: the client's, every sample's, and the server's own
    (sync,) = report["sync"]
    assert sync["engine_version"] == version
    assert get_json(server.url + "/model_info")["weight_version"] == str(version)
    figures(f"weight sync {method}: seconds", sync["seconds"])
    if method != "disk":
        assert report["sync_buckets"] > 1  # the session spans several update calls

    # the generations changed
    before = [tuple(g[0]["response_ids"]) for g in report["generate"]["before_greedy"]["groups"]]
    after = [tuple(g[0]["response_ids"]) for g in report["generate"]["after_greedy"]["groups"]]
    assert before != after, "greedy generations did not change after the weight update"

    # SGLang now computes with the learner's updated weights ...
    after_score = report["score"]["after"]
    figures(f"parity after {method} sync: max |diff|", after_score["max_abs_diff"])
    assert after_score["max_abs_diff"] <= LOGPROB_TOL, after_score["max_abs_diff"]
    # ... and the check is sensitive: the old samples' log-probs do not fit the new learner
    control = report["score"]["control"]
    figures(f"negative control ({method}): max |old sglang - new learner|", control["max_abs_diff"], worst=min)
    assert control["max_abs_diff"] > 100 * LOGPROB_TOL, control["max_abs_diff"]
