"""TEST SUPPORT ONLY, not part of gspo_mcore: one fix that lets SGLang 0.5.23 return routed experts on a CPU.

The integration tier puts this directory on the SGLang server's ``PYTHONPATH`` (next to the ``sgl_kernel``
stand-in), so Python imports this module at start-up in the server and in every process it spawns.

The fix: with ``--enable-return-routed-experts``, SGLang's ``RoutedExpertsCapturer`` (``srt/state_capturer/
base.py``, ``BaseHostCache``) allocates its host buffer with ``ALLOC_MEMORY_FUNCS[device]`` and
``pin_memory=True``; for ``device == "cpu"`` that is ``alloc_with_host_register``
(``srt/mem_cache/pool_host/common.py``), which calls ``cudaHostRegister`` through ``torch.cuda.cudart()`` and
fails at start-up on a machine without CUDA ("Found no NVIDIA driver"). On a CPU the host buffer is already
where the device buffer is, so pinning has no purpose: the fix registers, for ``"cpu"`` only, the same
allocation without the CUDA registration. Nothing else in SGLang's capture path is changed (the experts are
captured by SGLang's own ``capture_routed_experts_if_allowed`` in ``srt/layers/moe/topk.py``).

The module is patched right after SGLang imports it (a meta-path hook), so processes that never import
SGLang pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "sglang.srt.mem_cache.pool_host.common"


def _patch(module) -> None:
    def alloc_cpu_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_cpu_unpinned


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
