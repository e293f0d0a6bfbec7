"""How far apart two drafters of a side-by-side comparison are, so that equal acceptance lengths can be
read: different weights that draft the same tokens, or the same drafter evaluated twice.

- `weight_difference(a, b)`: over the tensors of both exports' model.safetensors, the largest absolute
  difference and the L2 norm of the difference relative to a's.
- `prompt_difference(report_a, report_b)`: prompts whose accepted-token sequence differs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def weight_difference(export_a: str | Path, export_b: str | Path, weights: str = "model.safetensors") -> dict[str, Any]:
    from safetensors.torch import load_file

    a, b = load_file(str(Path(export_a) / weights)), load_file(str(Path(export_b) / weights))
    if a.keys() != b.keys():
        return {"same_tensors": False, "only_a": sorted(a.keys() - b.keys()), "only_b": sorted(b.keys() - a.keys())}
    max_abs, diff_sq, norm_sq, differing = 0.0, 0.0, 0.0, 0
    for name in sorted(a):
        x, y = a[name].double(), b[name].double()
        delta = (x - y).abs()
        max_abs = max(max_abs, float(delta.max()) if delta.numel() else 0.0)
        diff_sq += float((delta * delta).sum())
        norm_sq += float((x * x).sum())
        differing += int(bool((delta > 0).any()))
    return {"same_tensors": True, "tensors": len(a), "tensors_differing": differing, "max_abs": max_abs,
            "relative_l2": math.sqrt(diff_sq / norm_sq) if norm_sq else None, "identical": differing == 0}


def prompt_difference(report_a: dict, report_b: dict) -> dict[str, Any]:
    by_id = {p["id"]: p for p in report_b.get("prompts") or []}
    shared = [(p, by_id[p["id"]]) for p in report_a.get("prompts") or [] if p["id"] in by_id]
    differ = [p["id"] for p, q in shared if p.get("accepted") != q.get("accepted")]
    return {"prompts": len(shared), "accepted_tokens_differ": len(differ)}


def describe(weights: dict[str, Any], prompts: dict[str, Any]) -> str:
    if not weights.get("same_tensors"):
        return "drafters          different tensor names: not the same architecture"
    return (f"drafters          {weights['tensors_differing']} of {weights['tensors']} tensors differ, max |Δ| "
            f"{weights['max_abs']:.3g}, relative L2 {weights['relative_l2']:.3g}; accepted tokens differ on "
            f"{prompts['accepted_tokens_differ']} of {prompts['prompts']} prompts")
