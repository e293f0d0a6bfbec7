"""The bf16-vs-fp8 leg of bench/gpu_end_to_end.py (`--compare-fp8`): issue 22's condition for shipping
`extract.aux_format = "fp8"` — the drafter trained on fp8 aux states loses at most 2 % of the
acceptance length of the one trained on bf16, same target, data, steps and seed, measured in one call.

- `summary`: both acceptance lengths with their 95 % bootstrap intervals (online_compare's method), the
  relative drop and the goal; both extractions' bytes per token and MB/s.
- `render`: the block printed at the end of the run.
"""

from __future__ import annotations

from typing import Any

GOAL_DROP = 0.02


def summary(bf16_eval: dict, fp8_eval: dict, bf16_extraction: dict, fp8_extraction: dict) -> dict[str, Any]:
    a, b = bf16_eval.get("acceptance_length"), fp8_eval.get("acceptance_length")
    drop = round(1.0 - b / a, 4) if a and b is not None else None
    iv_a, iv_b = bf16_eval.get("interval"), fp8_eval.get("interval")

    def per_token(extraction: dict) -> float | None:
        return round(extraction["bytes"] / extraction["tokens"], 1) if extraction.get("tokens") else None

    return {
        "acceptance": {"bf16": bf16_eval, "fp8": fp8_eval, "drop": drop, "goal": GOAL_DROP,
                       "intervals_overlap": bool(iv_a and iv_b and iv_a[0] <= iv_b[1] and iv_b[0] <= iv_a[1]),
                       "met": bool(drop is not None and drop <= GOAL_DROP)},
        "disk": {"bf16_bytes_per_token": per_token(bf16_extraction), "fp8_bytes_per_token": per_token(fp8_extraction),
                 "bf16_mb_s": bf16_extraction.get("mb_s"), "fp8_mb_s": fp8_extraction.get("mb_s"),
                 "bf16_tok_s": bf16_extraction.get("tok_s"), "fp8_tok_s": fp8_extraction.get("tok_s")},
    }


def render(block: dict[str, Any]) -> str:
    acc, disk = block["acceptance"], block["disk"]

    def al(side: dict) -> str:
        iv = side.get("interval") or [None, None]
        return f"{side.get('acceptance_length')} [{iv[0]}–{iv[1]}] over {side.get('prompts')} prompts"

    ratio = (disk["fp8_bytes_per_token"] / disk["bf16_bytes_per_token"]
             if disk["fp8_bytes_per_token"] and disk["bf16_bytes_per_token"] else None)
    lines = [
        "── fp8 vs bf16 aux states (same target, dataset, steps, seed) " + "─" * 17,
        f"acceptance length  bf16 {al(acc['bf16'])}",
        f"                   fp8  {al(acc['fp8'])}",
        (f"                   drop {acc['drop']} (goal <= {acc['goal']}: {'met' if acc['met'] else 'NOT met'}); "
         f"intervals overlap: {acc['intervals_overlap']}"),
        (f"disk               {disk['bf16_bytes_per_token']} vs {disk['fp8_bytes_per_token']} bytes per token"
         + (f" ({ratio:.3f})" if ratio else "")),
        (f"extraction         bf16 {disk['bf16_tok_s']} tok/s {disk['bf16_mb_s']} MB/s; fp8 {disk['fp8_tok_s']} tok/s "
         f"{disk['fp8_mb_s']} MB/s"),
        "─" * 78,
    ]
    return "\n".join(lines)
