"""gspo_mcore.platform.megatron_cpu: the one adapter of megatron-core to a CPU-only host."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from gspo_mcore.platform import megatron_cpu


def test_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_cpu.apply() is False


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="the adapter is inactive with a GPU")
def test_redirects_megatron_only_idempotent_and_warns_on_unchecked_versions():
    script = textwrap.dedent("""
        import warnings, torch
        import megatron.core
        from gspo_mcore.platform import megatron_cpu
        megatron.core.__version__ = "0.0.0-unchecked"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert megatron_cpu.apply() and megatron_cpu.apply() and megatron_cpu.is_active()
        assert sum("checked on megatron-core" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]
        from megatron.core.pipeline_parallel import schedules
        assert schedules.torch.cuda.current_device() == torch.device("cpu")
        assert schedules.torch.zeros(2, device="cuda").device.type == "cpu"
        assert schedules.torch.Tensor is torch.Tensor
        try:  # the real torch is untouched
            torch.zeros(1, device="cuda")
        except (RuntimeError, AssertionError):
            pass
        else:
            raise SystemExit("real torch was redirected")
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]
