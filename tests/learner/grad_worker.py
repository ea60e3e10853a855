"""Worker: the learner's GSPO gradient vs autograd through an independent single-process torch model.

The learner packs the samples into micro-batches (padded rows for the untied model, block-diagonal
rows for the tied one). The torch side re-implements the Qwen3 forward (RMSNorm, GQA with QK-norm, RoPE,
SwiGLU) from the learner's weights, runs each sample on its own (no packing, no Megatron, no gspo_mcore
ops), computes the GSPO loss directly from the paper's formula, and backpropagates with autograd. Writes
one JSON line per model with the largest gradient difference and the largest gradient entry.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from helpers import learner_toy as toy


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta):
    """``x``: (S, H, D); non-interleaved (rotate-half) rotary embedding at positions 0..S-1."""
    S, _, D = x.shape
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)  # (S, D/2)
    emb = torch.cat([freqs, freqs], -1)[:, None, :]  # (S, 1, D)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def qwen3_logits(w, cfg, tokens):
    """Logits ``(S, V)`` of one sequence; ``w``: Megatron parameter names -> tensors (1 rank)."""
    H, G, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, S = cfg["rms_norm_eps"], tokens.shape[0]
    x = w["embedding.word_embeddings.weight"][tokens]  # (S, hidden)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    for i in range(cfg["num_hidden_layers"]):
        p = f"decoder.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        qkv = (h @ w[p + "self_attention.linear_qkv.weight"].T).view(S, G, (H // G + 2) * D)
        q, k, v = qkv.split([H // G * D, D, D], dim=-1)  # per KV group: its query heads, then k, then v
        q = q.reshape(S, H, D)
        q = rope(rms_norm(q, w[p + "self_attention.q_layernorm.weight"], eps), cfg["rope_theta"])
        k = rope(rms_norm(k, w[p + "self_attention.k_layernorm.weight"], eps), cfg["rope_theta"])
        k = k.repeat_interleave(H // G, dim=1)  # (S, H, D): query head j uses KV group j // (H/G)
        v = v.repeat_interleave(H // G, dim=1)
        scores = torch.einsum("shd,thd->hst", q, k) / math.sqrt(D)
        attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        o = torch.einsum("hst,thd->shd", attn, v).reshape(S, H * D)
        x = x + o @ w[p + "self_attention.linear_proj.weight"].T
        h = rms_norm(x, w[p + "pre_mlp_layernorm.weight"], eps)
        gate, up = (h @ w[p + "mlp.linear_fc1.weight"].T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ w[p + "mlp.linear_fc2.weight"].T
    x = rms_norm(x, w["decoder.final_layernorm.weight"], eps)
    out = w["embedding.word_embeddings.weight"] if cfg["tie_word_embeddings"] else w["output_layer.weight"]
    return x @ out.T


def gspo_loss(w, cfg, samples, eps_low=3e-4, eps_high=4e-4):
    """``-(1/N) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)``, ``s_i = exp(mean_t logratio)``,
    over the ``N`` samples with at least one response token (a prompt-only sample has no ``s_i``)."""
    terms = []
    for s in [s for s in samples if s.loss_mask[1:].any()]:
        logits = qwen3_logits(w, cfg, s.tokens)[:-1]  # position t predicts token t+1
        logp = torch.log_softmax(logits, -1).gather(-1, s.tokens[1:, None])[:, 0]
        mask = s.loss_mask[1:].float()
        seq_ratio = torch.exp(((logp - s.old_logprobs) * mask).sum() / mask.sum())
        adv = torch.tensor(s.advantage)
        terms.append(torch.minimum(seq_ratio * adv, seq_ratio.clamp(1 - eps_low, 1 + eps_high) * adv))
    return -torch.stack(terms).sum() / len(terms)


def run(model_name, packing):
    from gspo_mcore.algo.loss_config import LossConfig
    from gspo_mcore.learner.forward import forward_logprobs
    from gspo_mcore.learner.model import build_model, unwrap
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.optimizer import OptimConfig, build_optimizer
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel
    from gspo_mcore.learner.step import BatchConfig, StepSettings, forward_backward, train_step

    cfg = toy.MODELS[model_name]
    arch = load_hf_config(cfg)
    layout = init_parallel(ParallelConfig(), arch, seed=1234)
    model = build_model(arch, ParallelConfig(), seed=11)
    # an odd number of samples, two of them prompt-only (not in N)
    samples = toy.toy_samples(vocab=arch.vocab_size, seed=3, num_samples=13, prompt_only=(2, 7))
    logp = forward_logprobs(model, samples, layout, max_tokens=40, packing=packing)
    batch = toy.with_offset_old_logprobs(samples, logp, "gspo")
    for chunk in model:
        chunk.zero_grad_buffer()
    metrics = forward_backward(model, batch, layout, LossConfig(variant="gspo"), max_tokens=40, packing=packing)
    named = dict(unwrap(model[0]).named_parameters())
    learner_grads = {n: p.main_grad.detach().clone() for n, p in named.items()}

    weights = {n: p.detach().clone().requires_grad_(True) for n, p in named.items()}
    loss = gspo_loss(weights, cfg, batch)
    loss.backward()
    scale = max(float(w.grad.abs().max()) for w in weights.values())
    worst, worst_name = 0.0, None
    for n, w in weights.items():
        diff = float((w.grad - learner_grads[n]).abs().max())
        if diff > worst:
            worst, worst_name = diff, n
    # train_step with the rollout engine's log-probs (here: the learner's + 0.05) and recomputation on:
    # the mismatch is reported, and the recomputed values are used (first sequence ratios are all 1).
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-4))
    rollout = [replace(s, old_logprobs=lp + 0.05) for s, lp in zip(samples, logp)]
    steps = train_step(
        model,
        optimizer,
        scheduler,
        rollout,
        layout,
        StepSettings(
            loss=LossConfig(),
            batch=BatchConfig(num_minibatches=2, max_tokens_per_microbatch=40, packing=packing),
            recompute_old_logprobs=True,
        ),
    )
    return dict(
        model=model_name,
        packing=packing,
        learner_loss=metrics["loss"],
        torch_loss=loss.item(),
        max_grad=scale,
        num_sequences=metrics["num_sequences"],
        max_grad_diff=worst,
        worst_param=worst_name,
        clip_fraction=metrics["clip_fraction"],
        num_params=len(weights),
        num_microbatches=metrics["num_microbatches"],
        rollout_logprob_abs_diff=steps[0]["rollout_logprob_abs_diff"],
        first_ratio_max=steps[0]["ratio_max"],
        first_ratio_min=steps[0]["ratio_min"],
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from gspo_mcore.learner.parallel import destroy_parallel

    with open(args.out, "w") as f:
        for name, packing in (("dense", "padded"), ("dense_tied", "block_diagonal")):
            f.write(json.dumps(run(name, packing)) + "\n")
    destroy_parallel()


if __name__ == "__main__":
    main()
