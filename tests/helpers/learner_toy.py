"""Toy models, a toy rollout batch and parameter bookkeeping shared by the learner tests and workers.

Imports nothing from megatron at module level (the pytest process stays light).
"""

from __future__ import annotations

import torch

DENSE = dict(
    model_type="qwen3",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
DENSE_TIED = dict(DENSE, tie_word_embeddings=True)
MOE = dict(
    DENSE,
    model_type="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    router_aux_loss_coef=0.0,
)
# Llama: 6 query heads on 2 KV heads (TP2: 3 + 1 per rank); Qwen2 (q/k/v biases), tied
LLAMA = dict(
    DENSE,
    model_type="llama",
    hidden_size=96,
    num_attention_heads=6,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
)
QWEN2_TIED = dict(DENSE, model_type="qwen2", tie_word_embeddings=True)
# a small tied Llama for the CPU-module tests (bf16 paths: split linear layers, gradient accumulation)
SMALL_LLAMA_TIED = dict(
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)
MODELS = {"dense": DENSE, "dense_tied": DENSE_TIED, "moe": MOE, "llama": LLAMA, "qwen2_tied": QWEN2_TIED}

# Per-sequence offsets added to the recomputed old log-probs: the first update then sees sequence ratios
# exp(-offset) far from every clip boundary (0.99/1.01 for GSPO, 0.74/1.35 for GRPO), so the clipping
# decisions, and hence the gradient, cannot flip between layouts on rounding noise.
OFFSETS = {
    "gspo": (-0.01, 0.0, 0.01),
    "gspo_token": (-0.01, 0.0, 0.01),
    "grpo": (-0.3, 0.0, 0.3),
    # SAPO has no boundary: ratio e^2 = 7.4 puts the gate at 0.007 (near 0), e^-0.5 at 0.95
    "sapo": (-2.0, 0.0, 0.5),
    # CISPO caps the weight at 4: e^1.6 = 4.95 is clipped, e^-1.6 = 0.2 is not (no lower bound)
    "cispo": (-1.6, 0.0, 1.6),
    # GMPO clips log-ratios at +-0.4: +-0.6 clips where the sign matches the advantage's
    "gmpo": (-0.6, 0.0, 0.6),
}


def toy_samples(
    *,
    num_samples: int = 12,
    vocab: int = 128,
    seed: int = 0,
    group_size: int = 4,
    prompt_only: tuple[int, ...] = (),
    env_spans: bool = False,
    shared_prompts: bool = False,
):
    """A rollout batch: prompt + response of varied lengths, group-relative advantages.

    ``prompt_only``: indices of samples with no counted token (loss mask all 0: they add nothing to the loss
    and are not counted in the normaliser ``N``).
    ``env_spans``: multi-turn episodes: every response of 5 or more tokens gets environment (tool) spans inside
    it (:func:`env_holes`), loss mask 0 between policy spans; the tokens drawn are the same.
    ``shared_prompts``: every sample of a group gets its group's first prompt (as a rollout group has); the
    responses are drawn as without it.
    ``num_samples`` need not be a multiple of ``group_size`` (the last group is cut short); the defaults
    draw the same batch as before these options existed.
    """
    from gspo_mcore.algo import group_advantages
    from gspo_mcore.learner.batching import TrainSample

    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(-(-num_samples // group_size) * group_size, generator=g)
    adv = group_advantages(rewards, group_size)[:num_samples]
    samples = []
    for i in range(num_samples):
        prompt = int(torch.randint(3, 9, (1,), generator=g))
        response = int(torch.randint(2, 17, (1,), generator=g))
        tokens = torch.randint(0, vocab, (prompt + response,), generator=g)
        if shared_prompts:
            if i % group_size == 0:
                group_prompt = tokens[:prompt]
            prompt = group_prompt.shape[0]
            tokens = torch.cat([group_prompt, tokens[-response:]])
        mask = torch.zeros(prompt + response, dtype=torch.int64)
        if i not in prompt_only:
            mask[prompt:] = 1
            if env_spans:
                for a, b in env_holes(response):
                    mask[prompt + a : prompt + b] = 0
        samples.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=float(adv[i])))
    return samples


def env_holes(response: int) -> list[tuple[int, int]]:
    """Environment spans ``[a, b)`` (offsets into a response of ``response`` tokens), each with policy tokens on
    both sides: policy, tool, policy (5+ tokens), and a second tool span for 10+ (policy, tool, policy, tool,
    policy), as a multi-turn episode gives."""
    if response < 5:
        return []
    first = (response // 3, response // 3 + 2)
    if response < 10:
        return [first]
    return [first, (2 * response // 3 + 1, 2 * response // 3 + 3)]


def with_offset_old_logprobs(samples, logprobs, variant: str):
    from dataclasses import replace

    offsets = OFFSETS[variant]
    return [replace(s, old_logprobs=lp + offsets[i % len(offsets)]) for i, (s, lp) in enumerate(zip(samples, logprobs))]


# Per-sequence log(pi_prox / mu) of the off-policy cases: weights exp(shift) = 1.22, 2.72, 0.37, 1, 0.74, so that
# with cap 2 TIS truncates one sequence in five and MIS masks two, all far from the cap on rounding noise
BEHAVIOUR_SHIFTS = (0.2, 1.0, -1.0, 0.0, -0.3)


def with_behaviour_logprobs(samples):
    """Behaviour (engine) log-probs ``mu = old_logprobs - shift`` per sequence (see ``BEHAVIOUR_SHIFTS``)."""
    from dataclasses import replace

    shifts = BEHAVIOUR_SHIFTS
    return [replace(s, behaviour_logprobs=s.old_logprobs - shifts[i % len(shifts)]) for i, s in enumerate(samples)]


def with_token_advantages(samples):
    """Per-token advantages that vary within each sequence: ``A_i + 0.8 * ramp`` (ramp from -1 to 1)."""
    from dataclasses import replace

    out = []
    for i, s in enumerate(samples):
        n = s.length - 1
        ramp = torch.linspace(-1.0, 1.0, n) * (0.8 if i % 2 else -0.8)
        out.append(replace(s, token_advantages=s.advantage + ramp))
    return out


def local_shards(model):
    """``[(key, global_shape, index, tensor)]`` for every floating-point tensor of this rank's model."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from gspo_mcore.learner.model import _flatten, unwrap

    out = []
    for sh in _flatten(unwrap(model[0]).sharded_state_dict(), ShardedTensorFactory):
        if not isinstance(sh, ShardedTensor) or not torch.is_tensor(sh.data) or sh.key.endswith("_extra_state"):
            continue
        if not sh.data.is_floating_point():
            continue
        n_prepend = sh.prepend_axis_num
        local_shape = tuple(sh.local_shape)
        if len(local_shape) == len(sh.global_shape) - n_prepend:
            local_shape = (1,) * n_prepend + local_shape
        index = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, local_shape))
        out.append((sh.key, tuple(sh.global_shape), index, sh.data.detach().float().reshape(local_shape).clone()))
    return out


def local_grad_shards(model):
    """:func:`local_shards` of the gradients (``main_grad``, what Megatron's DDP reduced over DP) instead of
    the parameters: the same keys, global shapes and slices, so layouts compare. Valid after a backward
    without the distributed optimizer (which reduce-scatters: each rank then holds only its part)."""
    params = [p for chunk in model for p in chunk.parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad  # sharded_state_dict reads .data: the grads come out laid out as the weights
        return local_shards(model)
    finally:
        for p, d in zip(params, saved):
            p.data = d


def assemble(shards) -> dict[str, torch.Tensor]:
    """Full tensors from the shards of a 1-rank model."""
    full = {}
    for key, shape, index, t in shards:
        full.setdefault(key, torch.full(shape, float("nan")))[index] = t
    for key, t in full.items():
        assert not torch.isnan(t).any(), f"{key} not fully covered by the 1-rank shards"
    return full


def per_key_diff_vs(shards, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per key, max |local shard - reference slice| over this rank's shards of that key."""
    out: dict[str, float] = {}
    for key, _, index, t in shards:
        out[key] = max(out.get(key, 0.0), float((t - reference[key][index]).abs().max()))
    return out


def max_diff_vs(shards, reference: dict[str, torch.Tensor]) -> tuple[float, list[str]]:
    """Max |local shard - reference slice| over this rank's shards, and the keys it holds."""
    worst = 0.0
    for key, _, index, t in shards:
        worst = max(worst, float((t - reference[key][index]).abs().max()))
    return worst, sorted({k for k, *_ in shards})


def toy_engine_setup(layout_name: str, *, seed: int = 7, max_batch_size: int = 8):
    """The engine workers' common start: parallel state for ``layout_name`` (``tp2``: 2 TP ranks; anything
    else: this launch's world as DP), the DENSE toy model, and the engines' keyword arguments.
    Returns ``(layout, arch, model, engine_kwargs)``."""
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    parallel = ParallelConfig(tensor=2) if layout_name == "tp2" else ParallelConfig()
    arch = load_hf_config(DENSE)
    layout = init_parallel(parallel, arch, seed=seed)
    model = build_model(arch, parallel, seed=seed)
    kwargs = {"eos_token_id": 2, "vocab_size": arch.vocab_size, "max_batch_size": max_batch_size}
    return layout, arch, model, kwargs
