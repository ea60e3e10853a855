"""Builds the compiled extension ``gspo_mcore._C``.

C++ CPU kernels are always built. CUDA kernels (``csrc/cuda/*.cu``) are added when ``nvcc`` and a CUDA
build of torch are both present, unless ``GSPO_MCORE_NO_CUDA=1``. ``TORCH_CUDA_ARCH_LIST`` overrides the
default architectures (sm_80 and sm_90: A100, H100/H200).
"""

import glob
import os
import re
import shutil
import subprocess
import tempfile

from setuptools import setup


def _cuda_home_from_nvcc() -> str | None:
    """The toolkit prefix, asked of nvcc itself.

    torch guesses CUDA_HOME from the folder of the ``nvcc`` on PATH; where that ``nvcc`` is a wrapper
    script the guess has no libraries and linking fails (``cannot find -lcudart``). ``nvcc --dryrun``
    prints ``#$ TOP=<toolkit>/bin/..``, which is the real prefix.
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cu")
        open(src, "w").close()
        try:
            out = subprocess.run(
                [nvcc, "--dryrun", "-c", src, "-o", os.path.join(tmp, "probe.o")],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
    m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    return os.path.realpath(m.group(1).strip()) if m else None


def _want_cuda() -> bool:
    if os.environ.get("GSPO_MCORE_NO_CUDA", "0") not in ("", "0"):
        return False
    if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
        home = _cuda_home_from_nvcc()
        if home is None:
            return False
        os.environ["CUDA_HOME"] = home
    import torch

    return torch.version.cuda is not None


WITH_CUDA = _want_cuda()
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

# Import after CUDA_HOME is settled: torch.utils.cpp_extension reads it at import time.
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

cpu_sources = sorted(glob.glob("csrc/*.cpp"))
# -fopenmp: at::parallel_for (rows of the log-prob kernels) runs on torch's OpenMP threads only when the
# extension itself is compiled and linked with OpenMP; without it every call is serial. The extension then
# needs libgomp.so.1, which torch has already loaded (one OpenMP runtime, torch's thread settings).
cxx_flags = ["-O3", "-fopenmp"]  # the C++ standard is the one torch asks for
link_flags = ["-fopenmp"]
if WITH_CUDA:
    ext = CUDAExtension(
        "gspo_mcore._C",
        cpu_sources + sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu")),
        define_macros=[("GSPO_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
        extra_link_args=link_flags,
    )
else:
    ext = CppExtension("gspo_mcore._C", cpu_sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
