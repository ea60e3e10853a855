"""Tiny Qwen3 / Qwen3-MoE / Llama / Qwen2 checkpoints built by transformers from a config (no download), digests,
and a launcher for the worker scripts. Shared by the pytest process and the gloo workers; imports
neither megatron nor transformers at module level."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest
import torch
from helpers import launch, worker_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# 8 query heads in 2 groups (4 per group: the q/k/v interleave is not the identity), a vocabulary that is
# not a power of two, an MLP width that TP2 splits into halves of gate and up.
COMMON = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_LLAMA = {k: v for k, v in COMMON.items() if k != "head_dim"} | dict(num_hidden_layers=2)
MODELS = {
    "dense": ("qwen3", dict(COMMON)),
    "dense_tied": ("qwen3", dict(COMMON, num_hidden_layers=2, tie_word_embeddings=True)),
    # layer 1 is a dense MLP layer inside the MoE model; top-k probabilities renormalised
    "moe": ("qwen3_moe", dict(COMMON, **MOE, norm_topk_prob=True, mlp_only_layers=[1])),
    # tied embeddings; top-k of the full softmax, not renormalised
    "moe_tied": ("qwen3_moe", dict(COMMON, **MOE, num_hidden_layers=2, tie_word_embeddings=True, norm_topk_prob=False)),
    # Llama: 6 query heads on 2 KV heads (3 per group, as SmolLM2's 9 on 3; TP2 holds 3 + 1 per rank),
    # head_dim from hidden_size / heads, SmolLM2's epsilon and RoPE base
    "llama": (
        "llama",
        dict(
            _LLAMA, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=100000.0
        ),
    ),
    # tied; an explicit head_dim (16) unrelated to hidden_size / heads (64 / 8)
    "llama_tied": ("llama", dict(_LLAMA, head_dim=16, tie_word_embeddings=True)),
    # Qwen2: q/k/v biases, no o_proj bias, no QK-norm
    "qwen2": ("qwen2", dict(_LLAMA, num_attention_heads=4)),
    "qwen2_tied": ("qwen2", dict(_LLAMA, hidden_size=96, num_attention_heads=6, tie_word_embeddings=True)),
}
CONFIGS = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "llama": "Llama", "qwen2": "Qwen2"}
"""model_type -> transformers class prefix (``{prefix}Config``, ``{prefix}ForCausalLM``)."""
TOKENS_SHAPE = (3, 11)


def build_hf_model(name: str, seed: int = 0):
    """A transformers model for ``MODELS[name]`` with every tensor drawn from ``seed``: matrices
    N(0, 0.1) (biases too), norm weights 1 + N(0, 0.2) (so q_norm and k_norm differ), router N(0, 1)."""
    import transformers

    model_type, kwargs = MODELS[name]
    prefix = CONFIGS[model_type]
    config = getattr(transformers, f"{prefix}Config")(**kwargs)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            if "norm" in pname:
                p.copy_(1 + 0.2 * noise)
            elif pname.endswith("mlp.gate.weight"):
                p.copy_(noise)
            else:
                p.copy_(0.1 * noise)
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], TOKENS_SHAPE, generator=torch.Generator().manual_seed(5))


def digest(t: torch.Tensor) -> str:
    """Bit-exact identity of a tensor: dtype, shape and bytes."""
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.uint8) if t.numel() else t
    return f"{t.dtype}:{tuple(t.shape)}:" + hashlib.sha1(raw.numpy().tobytes()).hexdigest()


def run(cmd: list[str], *, timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` (from the repository root, 1 thread per rank); fail the test with its output on error."""
    env = worker_env()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"{what} timed out after {timeout} s\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-8000:]}")
    if proc.returncode != 0:
        pytest.fail(
            f"{what} failed (exit {proc.returncode})\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def torchrun(script: str, nproc: int, args: list[str]) -> list[str]:
    return [*launch.torchrun(nproc), script, *args]
