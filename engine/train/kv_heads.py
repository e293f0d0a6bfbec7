"""Grouped-query attention helpers shared by the TTT attention backends: query heads come in groups
that share one key/value head."""

from __future__ import annotations

import torch


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv, T, d] -> [B, kv*groups, T, d], each key/value head repeated for its query group."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sum_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The adjoint of repeat_kv: [B, kv*groups, ...] -> [B, kv, ...], summing each group's gradients."""
    return x if groups == 1 else x.unflatten(1, (-1, groups)).sum(2)
