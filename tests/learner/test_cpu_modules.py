"""The compiled RMSNorm and SwiGLU in the model (:mod:`gspo_mcore.platform.cpu_norm`,
:mod:`gspo_mcore.platform.cpu_mlp`): every ``torch.nn.RMSNorm`` and every plain ``MLP`` of a CPU model built with
``model.options.cpu_rms_norm`` / ``cpu_swiglu`` (the defaults) becomes a ``CpuRMSNorm`` / ``CpuMLP`` with the same
parameters and state-dict keys; a Qwen3 model (query and key norms too) gives the same logits and gradients with
them as without, within float32 rounding; so does the compiled RoPE (:mod:`gspo_mcore.platform.cpu_rope`,
``model.options.cpu_rope``). Likewise the row-split linear layers (:mod:`gspo_mcore.platform.cpu_linear`,
``model.options.cpu_split_linear``) in a bfloat16 model, within bfloat16 rounding, with and without LoRA."""

from __future__ import annotations

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.platform.cpu_norm import CpuRMSNorm, use_compiled_rms_norm

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="the compiled extension is not built")


def _stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.RMSNorm(24, eps=1e-6), torch.nn.Linear(24, 24), torch.nn.RMSNorm(24))


def test_swapped_modules_keep_their_state_and_results():
    """float32 (the kernels' bf16 numerics against float64 are tests/ops/test_ops_rms_norm.py)."""
    dtype = torch.float32
    plain, fast = _stack().to(dtype), _stack().to(dtype)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.1 * torch.randn_like(p))
    fast.load_state_dict(plain.state_dict())
    assert use_compiled_rms_norm(fast) == 2
    assert [type(m) for m in fast] == [CpuRMSNorm, torch.nn.Linear, CpuRMSNorm]
    assert fast.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(5, 3, 24).to(dtype)
    outs = []
    for model in (plain, fast):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.float().square().sum().backward()
        outs.append((y.detach(), xi.grad, model[0].weight.grad, model[2].weight.grad))
    for a, b in zip(*outs):  # equal up to float32 rounding: sums over rows differ in order
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * a.abs().max().item())


def test_calls_it_does_not_cover_run_torch_forward():
    norm = torch.nn.RMSNorm([3, 4]).half()  # two normalised dimensions, float16
    use_compiled_rms_norm(norm)
    x = torch.randn(2, 3, 4).half()
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, [3, 4], norm.weight))


def _rank(rank, world, arch_kw):
    from megatron.core import parallel_state as ps

    from gspo_mcore.learner.model import ModelOptions, build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    arch = load_hf_config(arch_kw)
    init_parallel(ParallelConfig(), arch, seed=1)
    out = {}
    try:
        tokens = torch.randint(0, arch.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(19)[None].expand(2, -1)
        from megatron.core.transformer.mlp import MLP

        from gspo_mcore.ops import rope as rope_ops

        for compiled in (False, True):
            options = ModelOptions(cpu_rms_norm=compiled, cpu_swiglu=compiled, cpu_rope=compiled)
            chunk = build_model(arch, ParallelConfig(), options, seed=1, wrap_ddp=False)[0]
            kinds = {type(m).__name__ for m in chunk.modules() if isinstance(m, (torch.nn.RMSNorm, MLP))}
            rope_ops._angles = None
            logits = chunk(tokens, positions, None)
            logits.float().square().mean().backward()
            grads = {n: p.grad.clone() for n, p in chunk.named_parameters()}
            out[compiled] = {
                "kinds": kinds,
                "logits": logits.detach(),
                "grads": grads,
                "rope": rope_ops._angles is not None,
            }
    finally:
        ps.destroy_model_parallel()
    return out


@pytest.mark.distributed
def test_the_built_model_uses_it_with_the_same_results():
    from helpers.dist_cases import run_ranks

    arch = dict(
        model_type="qwen3",  # query and key norms as well as the layers' and the final one
        vocab_size=96,
        hidden_size=40,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=10,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    got = run_ranks(_rank, 1, args=(arch,))[0]
    assert got[False]["kinds"] == {"RMSNorm", "MLP"}
    assert got[True]["kinds"] == {"CpuRMSNorm", "CpuMLP"}
    assert got[True]["rope"] and not got[False]["rope"]  # the compiled RoPE ran (its angles were taken) or not
    torch.testing.assert_close(got[True]["logits"], got[False]["logits"], rtol=1e-5, atol=1e-5)
    assert got[True]["grads"].keys() == got[False]["grads"].keys()
    assert sum("norm" in n for n in got[True]["grads"]) >= 4 and sum("fc1" in n for n in got[True]["grads"]) == 2
    for name, g in got[False]["grads"].items():
        scale = g.abs().max().item()
        torch.testing.assert_close(got[True]["grads"][name], g, rtol=1e-4, atol=1e-5 * scale, msg=name)


def _split_rank(rank, world, arch_kw):
    from megatron.core import parallel_state as ps

    from gspo_mcore.learner.lora import LoraConfig
    from gspo_mcore.learner.model import ModelOptions, build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel
    from gspo_mcore.ops import gemm

    torch.set_num_threads(2)
    gemm.MIN_ROWS = 1  # split even these few rows (38 tokens) across the two threads
    arch = load_hf_config(arch_kw)
    init_parallel(ParallelConfig(), arch, seed=1)
    out = {}
    try:
        tokens = torch.randint(0, arch.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(19)[None].expand(2, -1)
        for lora in (None, LoraConfig(rank=4, alpha=8, target_modules="all-linear")):
            for split in (False, True):
                options = ModelOptions(cpu_bf16=True, cpu_split_linear=split)
                chunk = build_model(arch, ParallelConfig(), options, seed=1, wrap_ddp=False, lora=lora)[0]
                if lora is not None:
                    with torch.no_grad():  # B starts at zero: make the adapters count
                        for n, p in chunk.named_parameters():
                            if n.endswith("lora_B"):
                                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(n)))
                kinds = {type(m).__name__ for m in chunk.modules() if "ParallelLinear" in type(m).__name__}
                logits = chunk(tokens, positions, None)
                logits.float().square().mean().backward()
                grads = {n: p.grad.float().clone() for n, p in chunk.named_parameters() if p.grad is not None}
                out[lora is not None, split] = {"kinds": kinds, "logits": logits.detach().float(), "grads": grads}
    finally:
        ps.destroy_model_parallel()
    return out


@pytest.mark.distributed
def test_split_linear_gives_the_same_results_in_bf16():
    from helpers.dist_cases import run_ranks
    from helpers.learner_toy import SMALL_LLAMA_TIED

    got = run_ranks(_split_rank, 1, args=(SMALL_LLAMA_TIED,))[0]
    for lora in (False, True):
        plain, split = got[lora, False], got[lora, True]
        assert not any(k.startswith("Cpu") for k in plain["kinds"]), plain["kinds"]
        assert any(k.startswith("Cpu") for k in split["kinds"]), split["kinds"]
        assert all(k.startswith(("Cpu", "LoRACpu")) for k in split["kinds"]), split["kinds"]
        scale = plain["logits"].abs().max().item()
        torch.testing.assert_close(split["logits"], plain["logits"], rtol=0, atol=2**-6 * scale)
        assert split["grads"].keys() == plain["grads"].keys()
        assert any("lora_A" in n for n in split["grads"]) == lora
        for name, g in plain["grads"].items():
            scale = g.abs().max().item()
            torch.testing.assert_close(split["grads"][name], g, rtol=0, atol=2**-5 * scale, msg=name)
