"""GPU benchmark of token_logprobs (run by tools/gpu_check.sh): the stats and backward kernels, the op's
forward and forward+backward at T=BENCH_T (16384), V=BENCH_V (151936) bf16 logits, against one streaming read
of the logits measured in the same run and against eager torch; then a correctness check at that size."""

import os
import statistics

import gspo_mcore._C  # noqa: F401
import torch

from gspo_mcore.ops import token_logprobs, use_reference

T = int(os.environ.get("BENCH_T", 16384))
V = int(os.environ.get("BENCH_V", 151936))
dev = "cuda"
torch.manual_seed(0)
logits = (torch.randn(T, V, device=dev) * 3).to(torch.bfloat16)
targets = torch.randint(0, V, (T,), device=dev)
grad_out = torch.randn(T, device=dev)
gbytes = logits.numel() * logits.element_size() / 1e9
print(f"[bench] T={T} V={V} bf16 logits = {gbytes:.2f} GB")


def timed(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# One streaming read of the logits, two ways; the smaller is the reference.
t_sum = timed(lambda: logits.sum(dtype=torch.float32))
buf = torch.empty_like(logits)
t_copy = timed(lambda: buf.copy_(logits))
buf = None  # free it before the kernels run
t_read = min(t_sum, t_copy / 2)
print(
    f"[bench] read reference: logits.sum() {t_sum:.3f} ms, copy/2 {t_copy / 2:.3f} ms -> READ = {t_read:.3f} ms "
    f"({gbytes / t_read:.2f} TB/s)"
)

ops = torch.ops.gspo_mcore
results = {}


def report(name, ms, ideal_reads):
    results[name] = ms
    ideal = f"(ideal ~{ideal_reads} x READ)" if ideal_reads else "(eager torch)"
    print(f"[bench] {name:<44s} {ms:8.3f} ms  = {ms / t_read:5.2f} x READ  {ideal}")


report("stats kernel (no entropy)", timed(lambda: ops.token_logprob_stats(logits, targets, 0, 1.0, False)), 1)
report("stats kernel (entropy)", timed(lambda: ops.token_logprob_stats(logits, targets, 0, 1.0, True)), 1)
stats = ops.token_logprob_stats(logits, targets, 0, 1.0, True)
lse = (stats[:, 0] + stats[:, 1].log()).contiguous()
report(
    "backward kernel (no entropy)",
    timed(lambda: ops.token_logprob_backward(logits, targets, lse, grad_out, None, None, 0, 1.0)),
    2,
)
ent = torch.zeros_like(lse)
report(
    "backward kernel (entropy)",
    timed(lambda: ops.token_logprob_backward(logits, targets, lse, grad_out, ent, grad_out, 0, 1.0)),
    2,
)

x = logits.detach().requires_grad_()


def ours_fwd():
    with use_reference(False), torch.no_grad():
        return token_logprobs(x, targets)


def ours_fwd_bwd():
    with use_reference(False):
        lp = token_logprobs(x, targets)
        return torch.autograd.grad(lp, x, grad_out)[0]


def eager_fwd():
    with torch.no_grad():
        return torch.log_softmax(x.float(), -1).gather(1, targets[:, None]).squeeze(1)


def eager_fwd_bwd():
    lp = torch.log_softmax(x.float(), -1).gather(1, targets[:, None]).squeeze(1)
    return torch.autograd.grad(lp, x, grad_out)[0]


report("gspo token_logprobs forward", timed(ours_fwd), 1)
report("gspo token_logprobs forward+backward", timed(ours_fwd_bwd), 3)
report("eager log_softmax+gather forward", timed(eager_fwd, warmup=2, reps=5), None)
report("eager log_softmax+gather forward+backward", timed(eager_fwd_bwd, warmup=2, reps=5), None)
speed_fwd = results["eager log_softmax+gather forward"] / results["gspo token_logprobs forward"]
speed_bwd = results["eager log_softmax+gather forward+backward"] / results["gspo token_logprobs forward+backward"]
print(f"[bench] SPEEDUP vs eager: forward {speed_fwd:.2f}x, forward+backward {speed_bwd:.2f}x")

# Correctness at full size against eager (float32 math on the same bf16 logits).
lp_ours, lp_ref = ours_fwd(), eager_fwd()
g_ours, g_ref = ours_fwd_bwd(), eager_fwd_bwd()
err_lp = (lp_ours - lp_ref).abs().max().item()
err_g = (g_ours.float() - g_ref.float()).abs().max().item()
scale_g = g_ref.float().abs().max().item()
print(
    f"[bench] CHECK max|logp - eager| = {err_lp:.3e}   max|dlogits - eager| = {err_g:.3e} (max|dlogits| {scale_g:.3e})"
)
ok = err_lp < 1e-3 and err_g <= 1e-2 * scale_g
print(f"[bench] CHECK {'OK' if ok else 'FAILED'}")
print(f"[bench] peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
raise SystemExit(0 if ok else 1)
