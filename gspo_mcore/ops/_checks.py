"""Argument checks shared by the ops and the algorithm layer: each error names the argument."""

from __future__ import annotations

import torch


def check_tensor(name: str, t, *, dim: int | None = None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but must be on {device} like the other inputs")


def check_length(name: str, t: torch.Tensor, expected: int, what: str) -> None:
    if t.shape[0] != expected:
        raise ValueError(f"{name} has {t.shape[0]} entries but {what} has {expected}")


def check_cu_seqlens(cu_seqlens, num_tokens: int, device) -> None:
    """``cu_seqlens`` ([B+1] int32/int64 offsets) must start at 0, be non-decreasing and end at T.

    Its values are checked at once on a CPU tensor. On an accelerator the check is queued with
    ``torch._assert_async`` so that the loss path never waits for the device.
    """
    check_tensor("cu_seqlens", cu_seqlens, dim=1, dtypes=(torch.int32, torch.int64), device=device)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must have B+1 >= 1 entries")
    if cu_seqlens.device.type == "cpu":
        if int(cu_seqlens[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(cu_seqlens[0])}")
        steps = cu_seqlens[1:] - cu_seqlens[:-1]
        if steps.numel() and bool((steps < 0).any()):
            b = int(torch.nonzero(steps < 0)[0, 0])
            raise ValueError(
                f"cu_seqlens must be non-decreasing, but cu_seqlens[{b}]={int(cu_seqlens[b])} > "
                f"cu_seqlens[{b + 1}]={int(cu_seqlens[b + 1])}"
            )
        if int(cu_seqlens[-1]) != num_tokens:
            raise ValueError(f"cu_seqlens must end at the number of tokens T={num_tokens}, got {int(cu_seqlens[-1])}")
    else:
        ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == num_tokens) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
        torch._assert_async(ok, "cu_seqlens must start at 0, be non-decreasing and end at T")
