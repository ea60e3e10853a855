"""Test support for the real-SGLang tier (not shipped): where the SGLang venv is, how a server is launched on a
CPU-only machine, and the tiny checkpoint the tests write.

The recipe (see ``README.md`` beside this file): SGLang 0.5.23 in its own virtual environment (``.venv-sglang``,
made by ``setup_sglang_env.sh``), ``SGLANG_USE_CPU_ENGINE=1``, the test stand-in ``sgl_kernel`` package
(``sgl_kernel_cpu/``) on ``PYTHONPATH``, torch-native attention, no overlap scheduler, no CUDA graphs; the trainer
side shares CPU tensors with torch's ``file_system`` strategy. The server is launched through the project's
own launcher (:mod:`gspo_mcore.rollout.sglang_server`), on loopback.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from functools import lru_cache

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def learner_env() -> dict[str, str]:
    """The environment of a learner worker (main venv, gloo on loopback) started from a test of this tier."""
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    )


VENV = os.environ.get("GSPO_SGLANG_VENV", os.path.join(ROOT, ".venv-sglang"))
PYTHON = os.path.join(VENV, "bin", "python")
STANDIN_DIR = os.path.join(HERE, "sgl_kernel_cpu")

# Server arguments that make SGLang 0.5.23 run on a CPU without SGLang's own CPU kernels.
# ``--dtype float32`` (the KV cache follows it): the learner runs in float32 on the CPU, and the tier's parity
# bound (LOGPROB_TOL below) relies on it; a float16 KV cache, what SGLang picked by default here, agreed with a
# float32 forward only to ~2e-4. A KV pool and context large enough for the multi-thousand-token generations
# the pause and kill tests need.
CPU_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-overlap-schedule",
    "--cuda-graph-backend-decode=disabled",
    "--cuda-graph-backend-prefill=disabled",
    "--max-total-tokens",
    "32768",
    "--dtype",
    "float32",
    "--kv-cache-dtype",
    "auto",
    "--skip-server-warmup",
    "--log-level",
    "info",
)

CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "PYTHONPATH": STANDIN_DIR,
    "GLOO_SOCKET_IFNAME": "lo",  # the weight-update group runs on loopback
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


@lru_cache(maxsize=1)
def sglang_missing() -> str | None:
    """Why the tier cannot run here (None when the SGLang venv is usable)."""
    if not os.path.exists(PYTHON):
        return (
            f"no SGLang environment at {VENV} (run `make test-sglang`, or "
            "tests/integration/setup_sglang_env.sh, to create it)"
        )
    try:
        out = subprocess.run(
            [PYTHON, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{PYTHON} does not run: {e}"
    if out.returncode != 0:
        return f"sglang is not installed in {VENV}: {out.stderr.strip()[-300:]}"
    from gspo_mcore.rollout.sglang_api import SGLANG_VERSION

    if out.stdout.strip() != SGLANG_VERSION:
        return (
            f"{VENV} has sglang {out.stdout.strip()}, the client is pinned to {SGLANG_VERSION} "
            "(rerun tests/integration/setup_sglang_env.sh)"
        )
    return None


# The tiny model: the tiny GSPO job's character tokenizer and Qwen3 shape (examples/tiny/task.py), with a
# longer context (generations of a few hundred tokens for the pause and kill tests) and random weights large
# enough that the distributions are far from uniform.
MAX_POSITIONS = 4096


def write_tiny_checkpoint(out_dir: str, *, seed: int = 0, moe: bool = False) -> str:
    """A random Qwen3 checkpoint (safetensors + config.json) with a locally built character tokenizer;
    ``moe``: the tiny Qwen3-MoE instead (2 layers, 4 experts, top-2; examples/tiny/task.py)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from examples.tiny.task import make_tokenizer, model_config

    os.makedirs(out_dir, exist_ok=True)
    make_tokenizer(out_dir)
    cfg = model_config(moe=moe)
    cfg["max_position_embeddings"] = MAX_POSITIONS
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    config = config_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    config.architectures = cfg["architectures"]
    model = model_cls(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        saved = json.load(f)
    saved["torch_dtype"] = saved["dtype"] = "float32"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return out_dir


# ------------------------------------------------------------------------------------ prompts
def encode(text: str) -> list[int]:
    """Token ids of ``text`` under the checkpoint's character tokenizer (examples/tiny/task.py)."""
    from examples.tiny.task import CHARS, SPECIALS

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    return [vocab[SPECIALS[1]]] + [vocab[c] for c in text]  # BOS, then the characters


PROMPTS = [encode(t) for t in ("rev:407>", "rev:12>", "rev:9981>", "add:3+4=", "hello world:")]


# ------------------------------------------------------------------------------------ servers
def server_config(model_path: str, log_dir: str, **kw):
    from gspo_mcore.rollout import SGLangServerConfig

    return SGLangServerConfig(
        model_path=model_path,
        python=PYTHON,
        extra_args=CPU_ARGS,
        env=dict(CPU_ENV),
        startup_timeout_s=600.0,
        log_path=None,
        **kw,
    )


def launch(configs, log_dir: str):
    from gspo_mcore.rollout.sglang_server import launch_servers

    t0 = time.monotonic()
    procs = launch_servers(configs, log_dir=log_dir)
    return procs, time.monotonic() - t0


def get_json(url: str, timeout: float = 30.0):
    """``GET url`` as JSON (test-side inspection of a server, outside the client under test)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


# ------------------------------------------------------------------------------------ parity
# Tolerance (``LOGPROB_TOL``): both sides run in float32 (the learner on the CPU always does; the server with
# ``--dtype float32``, which also makes its KV cache float32). They differ only in kernels and summation
# order (torch-native SDPA vs Megatron's local attention, SGLang's RMSNorm and RoPE vs Megatron's), which on
# this 2-layer model moves a log-prob by a few 1e-6 (measured: max 3.8e-6, mean 8e-7 over ~500 tokens per
# sampling setting; 5.2e-6 at worst over the tier's tests, docs/results/sglang.md; the tier's summary prints the
# figures of each run). The bound is 1.5e-5 nats, about 3 x the worst measured case (tightened from 1e-4
# without a rerun: the SGLang environment was not available when it was changed), and far below what a wrong
# weight (a transposed or mis-split tensor, a missing norm) does: the negative control in
# ``test_real_weight_sync.py`` shows differences of order 1. With
# SGLang's default float16 KV cache the agreement is only about 2e-4, hence
# ``--dtype float32``.
LOGPROB_TOL = 1.5e-5
EOS = 2


def check_samples(gen: dict, params: dict, n: int, prompts, version: int) -> None:
    """The shape of what ``generate`` returned: ``n`` samples per prompt, in order, with a log-prob for every
    response token."""
    groups = gen["groups"]
    assert len(groups) == len(prompts)
    for i, (group, prompt) in enumerate(zip(groups, prompts)):
        assert len(group) == n, f"prompt {i}: {len(group)} samples, expected {n}"
        for j, s in enumerate(group):
            where = f"prompt {i} sample {j}"
            assert (s["prompt_index"], s["sample_index"]) == (i, j), where
            assert list(s["prompt_ids"]) == list(prompt), where
            ids, lps = s["response_ids"], s["response_logprobs"]
            assert 1 <= len(ids) <= params["max_new_tokens"], f"{where}: {len(ids)} tokens"
            assert len(lps) == len(ids), f"{where}: {len(lps)} log-probs for {len(ids)} tokens"
            assert all(math.isfinite(x) and x <= 1e-6 for x in lps), f"{where}: log-probs {lps}"
            assert all(0 <= t < 64 for t in ids), where
            if s["finish_reason"] == "length":
                assert len(ids) == params["max_new_tokens"], where
            else:
                assert s["finish_reason"] == "stop" and ids[-1] == EOS and not params.get("ignore_eos"), where
            assert s["weight_version"] == version, where
