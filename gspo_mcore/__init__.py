"""gspo_mcore: GSPO reinforcement learning on Megatron-Core with fused log-prob kernels."""

__version__ = "0.1.0"
