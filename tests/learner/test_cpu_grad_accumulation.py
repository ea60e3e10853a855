"""The one-pass gradient accumulation of a CPU learner (:mod:`gspo_mcore.platform.cpu_grad_accumulation`,
``model.options.cpu_grad_accumulation``): a bf16 model's float32 gradient buffers after two micro-batches are exactly
those of Megatron's ``main_grad.add_(grad)`` (the same float32 sums of the same bf16 values), on 1 rank and after the
data-parallel all-reduce at DP2. The tied embedding's, whose token rows now go straight into the buffer in float32
(Megatron sums them in bf16 first), agree within bf16 rounding, and its rows are exactly the float32 sums of the
output gradient's rows by token. An fp32 model is left to Megatron."""

from __future__ import annotations

import pytest
import torch
from helpers.learner_toy import SMALL_LLAMA_TIED

from gspo_mcore import ops

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="the compiled extension is not built")


def _rank(rank, world, arch_kw):
    from megatron.core import parallel_state as ps

    from gspo_mcore.learner.model import ModelOptions, build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    torch.set_num_threads(1)
    arch = load_hf_config(arch_kw)
    init_parallel(ParallelConfig(), arch, seed=1)
    out = {}
    try:
        gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data
        batches = [torch.randint(0, arch.vocab_size, (2, 19), generator=gen) for _ in range(2)]
        positions = torch.arange(19)[None].expand(2, -1)
        for bf16, fused in ((True, False), (True, True), (False, True)):
            options = ModelOptions(cpu_bf16=bf16, cpu_grad_accumulation=fused)
            ddp = build_model(arch, ParallelConfig(), options, seed=1)[0]
            ddp.zero_grad_buffer()
            for tokens in batches:  # two micro-batches accumulate into the buffers
                ddp(tokens, positions, None).float().square().mean().backward()
            left = [n for n, p in ddp.module.named_parameters() if p.grad is not None]
            kinds = {type(m).__name__ for m in ddp.module.modules() if "Embedding" in type(m).__name__}
            ddp.finish_grad_sync()
            out[bf16, fused] = {
                "hooked": sum(len(p._post_accumulate_grad_hooks or {}) for p in ddp.module.parameters()),
                "left": left,
                "kinds": kinds,
                "grads": {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()},
            }
    finally:
        ps.destroy_model_parallel()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_one_pass_accumulation_gives_megatrons_buffers(world):
    from helpers.dist_cases import run_ranks

    for got in run_ranks(_rank, world, args=(SMALL_LLAMA_TIED,)):
        plain, fused = got[True, False], got[True, True]
        assert plain["hooked"] == 0 and fused["hooked"] == len(fused["grads"]) > 0
        assert fused["left"] == [] and plain["left"] == []  # every gradient went into the buffers
        assert fused["grads"].keys() == plain["grads"].keys()
        assert any("embedding" in n for n in fused["grads"])  # the tied weight: embedding and LM head both
        assert "CpuVocabParallelEmbedding" in fused["kinds"] and "CpuVocabParallelEmbedding" not in plain["kinds"]
        for name, g in plain["grads"].items():
            assert g.dtype == torch.float32 and g.abs().max() > 0, name
            if "word_embeddings" in name:  # the tied weight: summed in float32 instead of in bf16
                torch.testing.assert_close(fused["grads"][name], g, rtol=2**-7, atol=2**-7 * g.abs().max().item())
                assert not torch.equal(fused["grads"][name], g)  # the float32 path did run
            else:
                assert torch.equal(fused["grads"][name], g), name
        assert got[False, True]["hooked"] == 0  # fp32: Megatron's add is already one pass


def test_the_hook_adds_once_and_leaves_fused_gradients_alone():
    from gspo_mcore.platform.cpu_grad_accumulation import _accumulate_into_main_grad

    p = torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.bfloat16))
    p.main_grad = torch.ones(5, 3)
    p.grad = torch.full((5, 3), 0.5, dtype=torch.bfloat16)
    _accumulate_into_main_grad(p)
    assert p.grad is None and torch.equal(p.main_grad, torch.full((5, 3), 1.5))
    _accumulate_into_main_grad(p)  # nothing left to add
    p.grad, p.grad_added_to_main_grad = torch.ones(5, 3, dtype=torch.bfloat16), True
    _accumulate_into_main_grad(p)  # a fused weight-gradient kernel already wrote main_grad: Megatron's rule
    assert p.grad is not None and torch.equal(p.main_grad, torch.full((5, 3), 1.5))
    p.zero_out_wgrad = True  # a shared weight (the tied embedding): its gradient is always added
    _accumulate_into_main_grad(p)
    assert p.grad is None and torch.equal(p.main_grad, torch.full((5, 3), 2.5))


def test_embedding_rows_go_into_main_grad_summed_by_token_in_float32():
    from gspo_mcore.platform.cpu_grad_accumulation import _EmbeddingIntoMainGrad

    g = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(11, 6, generator=g).bfloat16())
    weight.main_grad = torch.randn(11, 6, generator=g)
    before = weight.main_grad.clone()
    ids = torch.tensor([[3, 3, 0, 10], [3, 7, 0, 3]])  # repeated tokens, a row never used
    out = _EmbeddingIntoMainGrad.apply(ids, weight)
    assert torch.equal(out, torch.nn.functional.embedding(ids, weight))
    grad = (torch.randn(2, 4, 6, generator=g) * 100).bfloat16()
    out.backward(grad)
    assert weight.grad is None  # nothing through autograd
    want = before.double().index_add_(0, ids.flatten(), grad.reshape(-1, 6).double())
    torch.testing.assert_close(weight.main_grad.double(), want, rtol=2**-22, atol=0)  # float32 sums
    assert torch.equal(weight.main_grad[[1, 2, 4, 5, 6, 8, 9]], before[[1, 2, 4, 5, 6, 8, 9]])
