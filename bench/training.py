"""Drafter training throughput at Llama-3.1-8B drafter shapes on one GPU.

    python bench/training.py [--lengths 2048 4096 16384] [--steps 6] [--backend flex|sdpa]

Random records (batch 1, bf16 states), the real training step of engine.train (teacher over the
full 128,256-token LM head, 7 TTT steps, AdamW on fp32 master weights, bf16 autocast). Reports
steady-state tokens/s, achieved TFLOP/s (model FLOPs, counted below) against the bf16 matmul rate
measured in the same run, and peak memory. SpecForge reference: 13,100 tok/s at 2048 and 15,900 at
4096 with 13.1 / 17.8 GiB peak; goal >= 1.25x.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.train.data import Batch, Teacher  # noqa: E402
from engine.train.loss import TTTModel  # noqa: E402
from engine.train.model import DraftConfig, Eagle3Drafter  # noqa: E402

SHAPES = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
              vocab_size=128256, draft_vocab_size=32000, rope_theta=500000.0, max_position_embeddings=131072,
              aux_layers_sglang=[2, 16, 29])


def matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t) / 1e12


def model_flops(cfg: DraftConfig, t: int, steps: int) -> float:
    """Matmul FLOPs of one training step (forward x3 for backward; teacher forward only)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size  # MACs per token
    head = h * cfg.draft_vocab_size
    per_step_tokens = 2 * t * (layer + head) * 3
    attn = 0.0
    for k in range(steps):  # causal QK^T and PV (half of T^2) plus the diagonal, forward + backward
        attn += 3 * 2 * 2 * cfg.num_attention_heads * d * (t * t / 2 + k * t)
    fc = 3 * 2 * t * 3 * cfg.target_hidden_size * h
    teacher = 2 * t * h * cfg.vocab_size
    return steps * per_step_tokens + attn + fc + teacher


def run_length(t: int, steps: int, iters: int, backend: str) -> dict:
    torch.manual_seed(0)
    cfg = DraftConfig(**SHAPES)
    model = Eagle3Drafter(cfg).cuda()
    hot = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    model.set_vocab(hot - torch.arange(cfg.draft_vocab_size), t2d)
    teacher = Teacher(torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.02,
                      hot)
    ttt = TTTModel(model, steps, backend)
    optim = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4, weight_decay=0.0)
    h = cfg.hidden_size
    batch = Batch(torch.randint(0, cfg.vocab_size, (1, t)), torch.ones(1, t, dtype=torch.bool),
                  torch.randn(1, t, 3 * h, dtype=torch.bfloat16), torch.randn(1, t, h, dtype=torch.bfloat16),
                  torch.tensor([t]))
    torch.cuda.reset_peak_memory_stats()

    def one_step():
        b = batch.to("cuda")
        out = teacher(b, torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = ttt(b, out)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 0.5)
        optim.step()

    for _ in range(2):  # compile + allocator warm-up
        one_step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        one_step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / iters
    result = {"tokens": t, "step_s": seconds, "tokens_per_s": t / seconds,
              "tflops": model_flops(cfg, t, steps) / seconds / 1e12,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del model, teacher, ttt, optim
    torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 16384])
    parser.add_argument("--steps", type=int, default=7, help="TTT steps")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--backend", default="flex", choices=["flex", "sdpa"])
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/training.py needs a CUDA GPU")
        return 2
    peak = matmul_tflops()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 matmul {peak:.0f} TFLOP/s")
    rows = []
    for t in args.lengths:
        try:
            r = run_length(t, args.steps, args.iters, args.backend)
        except torch.OutOfMemoryError as exc:
            r = {"tokens": t, "error": f"OOM: {str(exc).splitlines()[0]}"}
            torch.cuda.empty_cache()
        rows.append(r)
        if "error" in r:
            print(f"T={t:6d}  {r['error']}")
        else:
            print(f"T={t:6d}  {r['tokens_per_s']:9.0f} tok/s  {r['tflops']:6.1f} TFLOP/s "
                  f"({100 * r['tflops'] / peak:4.1f}% of matmul)  peak {r['peak_gib']:5.1f} GiB", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_tflops": peak, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
