"""gspo_mcore: GSPO reinforcement learning on Megatron-Core with fused log-prob kernels."""

import torch  # noqa: F401  (loads libc10/libtorch, which the compiled extension gspo_mcore._C links against)

__version__ = "0.1.0"
