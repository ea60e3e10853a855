"""SGLang's LoRA adapter path (``rollout.sglang.lora_mode: adapter``): request shapes, server flags, the client's
sequence of calls, the weight-sync bytes, and the refusals.

The request bodies and the server flags are checked against SGLang 0.5.23's own code, imported in a subprocess of
the SGLang environment (``GSPO_SGLANG_VENV``, default ``.venv-sglang``; see tests/integration/README.md): each body
is validated the way SGLang's HTTP server validates it (pydantic over its ``io_struct`` request class; ``/generate``
also through ``api_contract``), a key that is not a field of the class fails (SGLang would ignore it silently), and
the tensors are deserialized with SGLang's own ``MultiprocessingSerializer``. The flags go through
``ServerArgs.add_cli_args``' parser. Without that environment those tests are skipped (with ``GSPO_SGLANG_TESTS=1``
they fail). The client's calls run against the stand-in server (sglang_standin.py; NOT SGLang).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess

import pytest
import torch

from gspo_mcore.rollout import SamplingParams, SGLangClientConfig, SGLangEngine, WeightUpdateError
from gspo_mcore.rollout import sglang_api as api
from gspo_mcore.rollout.sglang_lora import CPU_REASON, adapter_name, adapter_nbytes, check_lora_mode, server_lora_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.environ.get("GSPO_SGLANG_VENV", os.path.join(ROOT, ".venv-sglang"))
PYTHON = os.path.join(VENV, "bin", "python")
STANDIN_DIR = os.path.join(ROOT, "tests", "integration", "sgl_kernel_cpu")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

FAST = dict(request_timeout_s=5.0, connect_timeout_s=5.0, control_timeout_s=5.0, weight_update_timeout_s=5.0)


# --------------------------------------------------------------------- a small adapter in PEFT's names
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, RANK = 16, 24, 4, 2, 4, 2, 4


def _adapter(rank: int = RANK, dtype=torch.float32) -> dict:
    """PEFT tensors of a rank-``rank`` adapter on all seven projections of a toy Qwen3 (2 layers)."""
    shapes = {  # projection -> (out, in)
        "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
        "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
        "mlp.gate_proj": (INTER, HIDDEN),
        "mlp.up_proj": (INTER, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTER),
    }
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(LAYERS):
        for proj, (o, i) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{proj}"
            out[f"{stem}.lora_A.weight"] = torch.randn((rank, i), generator=g).to(dtype)
            out[f"{stem}.lora_B.weight"] = torch.randn((o, rank), generator=g).to(dtype)
    return out


def _config(rank: int = RANK) -> dict:
    from gspo_mcore.learner.hf.export_peft import adapter_config
    from gspo_mcore.learner.lora import LoraConfig

    return adapter_config(LoraConfig(rank=rank, alpha=2.0 * rank), base_model="/models/base", targets=TARGETS)


# ------------------------------------------------------------------ checked by SGLang 0.5.23's own code
_CHECKER = r"""
import argparse, contextlib, io, json, sys
import msgspec
from pydantic import TypeAdapter
from sglang.srt.managers import io_struct
from sglang.srt.utils import MultiprocessingSerializer
from sglang.api.v1.api_types import GenerateRequest, JsonContractError
from sglang.srt.server_args import ServerArgs

cases = json.load(sys.stdin)
out = {}
for key, kind, payload in cases:
    try:
        if kind == "argv":
            parser = argparse.ArgumentParser(exit_on_error=False)
            ServerArgs.add_cli_args(parser)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    ns = parser.parse_args(["--model-path", "m", *payload])
                except SystemExit:
                    raise ValueError(err.getvalue().strip().splitlines()[-1])
            out[key] = {"ok": True, "enable_lora": ns.enable_lora, "max_lora_rank": ns.max_lora_rank,
                        "lora_target_modules": ns.lora_target_modules}
            continue
        cls_name, body = payload
        if cls_name == "GenerateReqInput":
            GenerateRequest.from_json_value(body)
            import dataclasses
            names = {f.name for f in dataclasses.fields(io_struct.GenerateReqInput)}
        else:
            cls = getattr(io_struct, cls_name)
            names = {f.name for f in msgspec.structs.fields(cls)}
        unknown = sorted(set(body) - names)
        if unknown:
            raise ValueError(f"not fields of {cls_name}: {unknown}")
        result = {"ok": True}
        if cls_name != "GenerateReqInput":
            obj = TypeAdapter(cls).validate_json(json.dumps(body))
            result["fields"] = {k: getattr(obj, k) for k in body if k != "serialized_named_tensors"}
            if "serialized_named_tensors" in body:
                ranks = [MultiprocessingSerializer.deserialize(b) for b in obj.serialized_named_tensors]
                result["tensors"] = [{k: [list(v.shape), str(v.dtype), float(v.double().sum())]
                                      for k, v in r.items()} for r in ranks]
        out[key] = result
    except (Exception, JsonContractError) as e:
        out[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
print("@@RESULT@@" + json.dumps(out, default=str))
"""


def _sglang_check(cases: list) -> dict:
    """Run the cases ``(key, kind, payload)`` through SGLang's own code in its environment."""
    if not os.path.exists(PYTHON):
        reason = f"no SGLang environment at {VENV} (GSPO_SGLANG_VENV; make test-sglang creates .venv-sglang)"
        if os.environ.get("GSPO_SGLANG_TESTS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=STANDIN_DIR, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [PYTHON, "-c", _CHECKER], input=json.dumps(cases), capture_output=True, text=True, env=env, timeout=600
    )
    marker = [line for line in proc.stdout.splitlines() if line.startswith("@@RESULT@@")]
    assert proc.returncode == 0 and marker, proc.stderr[-4000:]
    return json.loads(marker[0].removeprefix("@@RESULT@@"))


@pytest.fixture(scope="module")
def sglang_verdicts():
    """Every body and flag set this module checks, and deliberately wrong ones, judged by SGLang in one subprocess
    (importing SGLang takes a while)."""
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        tensors = _adapter()  # alive until SGLang has read the shared memory
        serialized = api.serialize_tensor_dict(tensors, 2)
        params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
        generate = api.build_generate_request([1, 2, 3], 2, params, prompt_index=0, lora_name=adapter_name(5))
        good = {
            "load_tensors": (
                "LoadLoRAAdapterFromTensorsReqInput",
                api.load_lora_from_tensors_body(adapter_name(5), _config(), serialized),
            ),
            "load_path": ("LoadLoRAAdapterReqInput", api.load_lora_body(adapter_name(5), "/runs/x/adapters/step_5")),
            "unload": ("UnloadLoRAAdapterReqInput", api.unload_lora_body(adapter_name(4))),
            "version": ("UpdateWeightVersionReqInput", api.weight_version_body(5)),
            "generate": ("GenerateReqInput", generate),
        }
        bad = {  # break-checks: what a wrong field name or flag looks like to SGLang
            "bad_load": ("LoadLoRAAdapterReqInput", {"lora_name": "x", "path": "/p"}),
            "bad_unload_extra": ("UnloadLoRAAdapterReqInput", {"lora_name": "x", "name": "x"}),
            "bad_version": ("UpdateWeightVersionReqInput", {"weight_version": "5", "abort_all_requests": False}),
            "bad_generate": ("GenerateReqInput", {**generate, "lora_name": generate["lora_path"]}),
        }
        cases = [[k, "body", list(v)] for k, v in {**good, **bad}.items()]
        cases.append(["argv", "argv", server_lora_args(RANK, TARGETS)])
        cases.append(["bad_argv_flag", "argv", ["--lora-rank", "4", "--enable-lora"]])
        cases.append(["bad_argv_module", "argv", ["--enable-lora", "--lora-target-modules", "linear_qkv"]])
        verdicts = _sglang_check(cases)
        verdicts["_tensors"] = tensors
        return verdicts
    finally:
        tmp.set_sharing_strategy(old)


@pytest.mark.parametrize("key", ["load_tensors", "load_path", "unload", "version", "generate"])
def test_request_bodies_pass_sglangs_own_validation(sglang_verdicts, key):
    assert sglang_verdicts[key]["ok"], sglang_verdicts[key]


def test_sglang_reads_the_fields_and_tensors_sent(sglang_verdicts):
    load = sglang_verdicts["load_tensors"]
    assert load["fields"]["lora_name"] == "gspo-policy-v5"
    assert load["fields"]["config_dict"]["r"] == RANK and load["fields"]["config_dict"]["lora_alpha"] == 2.0 * RANK
    assert sorted(load["fields"]["config_dict"]["target_modules"]) == sorted(TARGETS)
    want = {k: [list(v.shape), str(v.dtype), float(v.double().sum())] for k, v in sglang_verdicts["_tensors"].items()}
    assert len(load["tensors"]) == 2  # one dict per TP rank, each the full adapter
    for rank in load["tensors"]:
        assert rank.keys() == want.keys()
        for k, (shape, dtype, total) in want.items():
            assert rank[k][:2] == [shape, dtype] and rank[k][2] == pytest.approx(total, rel=1e-12, abs=1e-9)
    assert sglang_verdicts["version"]["fields"] == {"new_version": "5", "abort_all_requests": False}
    assert sglang_verdicts["load_path"]["fields"]["lora_path"] == "/runs/x/adapters/step_5"


def test_wrong_field_names_and_flags_fail_sglangs_checks(sglang_verdicts):
    """The checks can fail: a wrong name for a required field, an extra key SGLang would ignore, a wrong flag."""
    for key in ("bad_load", "bad_unload_extra", "bad_version", "bad_generate", "bad_argv_flag", "bad_argv_module"):
        assert not sglang_verdicts[key]["ok"], (key, sglang_verdicts[key])
    assert "lora_name" in sglang_verdicts["bad_generate"]["error"]
    assert "--lora-rank" in sglang_verdicts["bad_argv_flag"]["error"]


def test_server_flags_parse_with_sglangs_server_args(sglang_verdicts):
    argv = sglang_verdicts["argv"]
    assert argv["ok"], argv
    assert argv["enable_lora"] is True and argv["max_lora_rank"] == RANK
    assert argv["lora_target_modules"] == TARGETS


# ------------------------------------------------------------------ the client's calls (stand-in server)
def _engine(servers, **config):
    return SGLangEngine([s.url for s in servers], config=SGLangClientConfig(**{**FAST, **config}))


def test_adapter_versions_load_under_new_names_set_the_version_and_are_named_in_requests(standins, file_system_sharing):
    a, b = standins(tp_size=2), standins()
    eng = _engine([a, b])
    params = SamplingParams(max_new_tokens=3, temperature=1.0)
    asyncio.run(eng.generate([[1, 2, 3]], 1, params))  # before any adapter: the base model, no lora_path
    first, second = _adapter(), {k: 2 * v for k, v in _adapter().items()}
    assert asyncio.run(eng.update_adapter(1, tensors=first, config_dict=_config())) == "gspo-policy-v1"
    assert asyncio.run(eng.update_adapter(2, tensors=second, config_dict=_config())) == "gspo-policy-v2"
    assert eng.weight_version == 2 and eng.lora_name == "gspo-policy-v2"
    out = asyncio.run(eng.generate([[1, 2, 3], [4, 5]], 2, params))
    assert all(s.weight_version == 2 for g in out for s in g)

    for server in (a, b):
        ops = [p for p in server.paths() if p not in ("/generate", "/server_info", "/model_info")]
        one = ["/pause_generation", "/flush_cache", "/load_lora_adapter_from_tensors", "/update_weight_version"]
        assert ops == [*one, "/continue_generation", *one, "/continue_generation", "/unload_lora_adapter"]
        assert server.loras == {"gspo-policy-v2": "__tensor__"}  # the old version unloaded
        gens = [body for p, body in server.calls if p == "/generate"]
        assert all(body.get("lora_path") == "gspo-policy-v2" for body in gens[1:])
        versions = [body for p, body in server.calls if p == "/update_weight_version"]
        assert versions == [api.weight_version_body(1), api.weight_version_body(2)]
        assert server.weight_version == "2"
    assert "lora_path" not in [body for p, body in a.calls + b.calls if p == "/generate"][0]
    loads = [body for p, body in a.calls if p == "/load_lora_adapter_from_tensors"]
    assert [len(body["serialized_named_tensors"]) for body in loads] == [2, 2]  # one per TP rank of server a
    assert all(body["config_dict"] == _config() for body in loads)
    got = a.received_adapters["gspo-policy-v2"]
    assert got.keys() == second.keys() and all(torch.equal(got[k], second[k]) for k in got)


def test_adapter_from_a_folder(standins):
    a = standins()
    eng = _engine([a])
    asyncio.run(eng.update_adapter(3, path="/runs/x/adapters/step_3"))
    assert [body for p, body in a.calls if p == "/load_lora_adapter"] == [
        {"lora_name": "gspo-policy-v3", "lora_path": "/runs/x/adapters/step_3", "pinned": False}
    ]
    assert eng.weight_version == 3 and a.weight_version == "3"


def test_a_refused_adapter_load_is_a_weight_update_error_and_keeps_the_old_adapter(standins, file_system_sharing):
    a = standins()
    eng = _engine([a])
    asyncio.run(eng.update_adapter(1, tensors=_adapter(), config_dict=_config()))
    a.loras["gspo-policy-v2"] = "__tensor__"  # the server already holds that name
    with pytest.raises(WeightUpdateError, match="gspo-policy-v2.*already loaded"):
        asyncio.run(eng.update_adapter(2, tensors=_adapter(), config_dict=_config()))
    assert eng.lora_name == "gspo-policy-v1" and eng.weight_version == 1


# ------------------------------------------------------------------------------- bytes and refusals
def test_adapter_sync_bytes_are_the_adapters_size():
    """One ``adapter`` push sends the PEFT tensors: per layer and projection ``r (in + out)`` values. With PEFT's
    names the shared ``A`` of the fused q/k/v (and gate/up) is sent once per projection."""
    per_layer = sum(
        RANK * (i + o)
        for o, i in [
            (HEADS * HEAD_DIM, HIDDEN),
            (KV_HEADS * HEAD_DIM, HIDDEN),
            (KV_HEADS * HEAD_DIM, HIDDEN),
            (HIDDEN, HEADS * HEAD_DIM),
            (INTER, HIDDEN),
            (INTER, HIDDEN),
            (HIDDEN, INTER),
        ]
    )
    assert adapter_nbytes(_adapter()) == LAYERS * per_layer * 4
    assert adapter_nbytes(_adapter(dtype=torch.bfloat16)) == LAYERS * per_layer * 2
    # SmolLM2-135M (30 layers, hidden 576, MLP 1536, 9 query and 3 KV heads of 64) at rank 16 in bfloat16: 9.8 MB
    smol = 30 * 16 * (3 * 576 + 576 + 192 + 192 + 576 + 576 + 2 * (576 + 1536) + 1536 + 576) * 2
    assert smol == 9_768_960


def test_adapter_mode_is_refused_on_a_cpu_with_the_reason():
    with pytest.raises(ValueError, match="rollout.sglang.lora_mode: adapter refused.*no GPU.*pin memory"):
        check_lora_mode("adapter", lora_rank=4, weight_sync="tensor", has_gpu=False)
    assert "needs a GPU driver" in CPU_REASON
    check_lora_mode("adapter", lora_rank=4, weight_sync="disk", has_gpu=True)
    check_lora_mode("merged", lora_rank=4, weight_sync="distributed", has_gpu=False)
    with pytest.raises(ValueError, match="needs LoRA"):
        check_lora_mode("adapter", lora_rank=0, weight_sync="tensor", has_gpu=True)
    with pytest.raises(ValueError, match="weight_sync='distributed'"):
        check_lora_mode("adapter", lora_rank=4, weight_sync="distributed", has_gpu=True)


def test_the_trainer_refuses_adapter_mode_at_start_up_without_a_gpu():
    from gspo_mcore.learner.lora import LoraConfig
    from gspo_mcore.trainer.backends import SGLangConfig, SGLangRollout

    cfg = SGLangConfig(urls=("http://127.0.0.1:9",), lora_mode="adapter")
    layout = dataclasses.make_dataclass("L", [("rank", int), ("world_size", int)])(0, 1)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no GPU.*pin memory"):
        SGLangRollout(cfg, model_dir="m", output_dir="o", layout=layout, lora=LoraConfig(rank=4))
    with pytest.raises(ValueError, match="lora_mode must be one of|lora_mode"):
        SGLangConfig(lora_mode="fused")


def test_server_lora_args():
    assert server_lora_args(8, ["q_proj", "v_proj"]) == [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
    ]
    with pytest.raises(ValueError):
        server_lora_args(0, TARGETS)


def test_the_trainers_adapter_push_from_disk(standins, tmp_path, monkeypatch):
    """``SGLangRollout`` with ``lora_mode: adapter`` and ``weight_sync: disk`` (a GPU pretended: the check passes):
    each sync writes the PEFT folder under the run's output and loads it under a new name; the samples name it."""
    import gspo_mcore.learner.hf.export_peft as export_peft
    from gspo_mcore.learner.lora import LoraConfig
    from gspo_mcore.trainer.backends import SGLangConfig, SGLangRollout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(export_peft, "live_adapter", lambda model, arch, lora, **kw: (_adapter(), _config()))
    a = standins()
    cfg = SGLangConfig(
        urls=(a.url,), lora_mode="adapter", weight_sync="disk", colocate=False, client=SGLangClientConfig(**FAST)
    )
    layout = dataclasses.make_dataclass("L", [("rank", int), ("world_size", int)])(0, 1)
    out = tmp_path / "run"
    rollout = SGLangRollout(cfg, model_dir="m", output_dir=str(out), layout=layout, lora=LoraConfig(rank=RANK))
    learner = dataclasses.make_dataclass("Learner", [("model", object), ("arch", object)])(None, None)
    try:
        rollout.sync_weights(learner, 1)
        rollout.sync_weights(learner, 2)
        groups = rollout.generate([[1, 2, 3]], 2, SamplingParams(max_new_tokens=3, temperature=1.0), seed=1)
    finally:
        rollout.close()
    loads = [body for p, body in a.calls if p == "/load_lora_adapter"]
    assert [b["lora_name"] for b in loads] == ["gspo-policy-v1", "gspo-policy-v2"]
    assert loads[1]["lora_path"] == str(out.resolve() / "adapters" / "step_2")
    assert sorted(os.listdir(loads[1]["lora_path"])) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not (out / "adapters" / "step_1").exists()  # only the served version is kept
    assert a.loras == {"gspo-policy-v2": loads[1]["lora_path"]}
    assert rollout.last_sync_bytes == adapter_nbytes(_adapter())
    assert all(s.weight_version == 2 for g in groups for s in g)
    assert [b["lora_path"] for p, b in a.calls if p == "/generate"] == ["gspo-policy-v2"]
