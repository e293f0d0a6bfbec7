"""Drafter training throughput at Llama-3.1-8B drafter shapes on one GPU.

    python bench/training.py [--lengths 2048 4096 16384] [--steps 7] [--backend flex|sdpa|flash|cudnn]
                             [--loss fused|fused-compiled|checkpoint ...] [--optim fused|foreach]
                             [--embed bf16|fp32] [--zero-grad early|late] [--chunk-rows N]
                             [--batches prefetched|pageable ...] [--compare] [--profile] [--cpu-smoke]

Random records (batch 1 unless --records, bf16 states), the real training step of engine.train (teacher over the
full 128,256-token LM head, 7 TTT steps, AdamW on fp32 master weights, bf16 autocast). Reports
steady-state tokens/s against SpecForge, achieved TFLOP/s (model FLOPs, counted below) against
the bf16 matmul rate measured in the same run, and peak allocated memory against SpecForge's.
SpecForge reference (its own trainer measured beside this one on an H200, issue 25): 14,243 tok/s at
2048 and 16,282 at 4096 with 13.1 / 17.8 GiB peak; goal >= 1.5x the tokens/s with no more memory.
bench/specforge_training.py runs SpecForge's trainer itself in the same process, for the live ratio.

  --compare     per length, first the previous implementation (checkpointed loss, foreach AdamW,
                fp32 embedding, grads zeroed after the forward), then the configuration(s) asked for
  --loss        several values run side by side (fused-compiled: TTTModel(compile_head=True))
  --batches     prefetched (the trainer's BatchPrefetcher: pinned, copied on a side stream when the
                step asks), prefetched-ahead (copied under the previous step: one more batch held)
                and/or pageable (copied inside the step, as before session 10)
  --profile     after timing, one more step under torch.profiler: the 15 CUDA kernels with the most
                total time (on CPU: the 15 ops with the most self time)
  --cpu-smoke   tiny shapes on the CPU, to check that the script runs (figures mean nothing)
  --shape e2e   the drafter of bench/gpu_end_to_end.py's target (hidden 640, vocab 8,192)
  --records N.. records per step, several values side by side (tokens/s counts all of them)
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.train.data import Batch, BatchPrefetcher, Teacher  # noqa: E402
from engine.train.loop import build_adamw, clip_gradients, place_drafter  # noqa: E402
from engine.train.loss import TTTModel  # noqa: E402
from engine.train.model import DraftConfig, Eagle3Drafter  # noqa: E402

SHAPES: dict[str, Any] = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
              vocab_size=128256, draft_vocab_size=32000, rope_theta=500000.0, max_position_embeddings=131072,
              aux_layers_sglang=[2, 16, 29])
# the drafter of the target bench/gpu_end_to_end.py trains (16 layers, hidden 640, vocab 8,192)
E2E_SHAPES: dict[str, Any] = dict(hidden_size=640, num_attention_heads=10, num_key_value_heads=2, intermediate_size=1728,
                  vocab_size=8192, draft_vocab_size=8192, max_position_embeddings=2048, aux_layers_sglang=[2, 8, 15])
SMOKE_SHAPES: dict[str, Any] = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
                    vocab_size=1000, draft_vocab_size=256, aux_layers_sglang=[2, 4, 6])
SPECFORGE = {2048: (14243.0, 13.1), 4096: (16282.0, 17.8)}  # tokens/s, peak GiB
GOAL = 1.5


@dataclass(frozen=True)
class Variant:
    loss: str = "fused"  # fused | fused-compiled | checkpoint
    optim: str = "fused"  # fused | foreach
    embed: str = "bf16"  # bf16 | fp32 (the frozen embedding on the GPU)
    early_zero_grad: bool = True  # grads freed before the forward instead of after it
    prefetch: bool = True  # the trainer's BatchPrefetcher (pinned, non-blocking side-stream copy) vs a pageable copy
    ahead: int = 0  # BatchPrefetcher(ahead=): 1 copies the next batch under the whole previous step

    @property
    def label(self) -> str:
        return (f"loss={self.loss} optim={self.optim} embed={self.embed} zero_grad={'early' if self.early_zero_grad else 'late'}"
                f" batches={('prefetched' + ('-ahead' if self.ahead else '')) if self.prefetch else 'pageable'}")


LEGACY = Variant("checkpoint", "foreach", "fp32", False, False)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_batch(cfg: DraftConfig, t: int, records: int, dtype: torch.dtype) -> Batch:
    """Random records in pageable host memory, as a loader reads them (seeded: both trainers see the same)."""
    h = cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    return Batch(torch.randint(0, cfg.vocab_size, (records, t), generator=g), torch.ones(records, t, dtype=torch.bool),
                 torch.randn(records, t, 3 * h, generator=g).to(dtype), torch.randn(records, t, h, generator=g).to(dtype),
                 torch.tensor([t] * records))


def build(cfg: DraftConfig, t: int, steps: int, backend: str, variant: Variant, device: torch.device,
          chunk_rows: int | None, records: int = 1):
    """Model, teacher, optimizer and one random record; returns the training-step closure and a close()."""
    gpu = device.type == "cuda"
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg)
    hot = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    model.set_vocab(hot - torch.arange(cfg.draft_vocab_size), t2d)
    if variant.embed == "bf16":
        place_drafter(model, device)
    else:
        model.to(device)
    head_dtype = torch.bfloat16 if gpu else torch.float32
    teacher = Teacher(torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=head_dtype) * 0.02, hot)
    ttt = TTTModel(model, steps, backend, chunk_rows=chunk_rows, fused_loss=variant.loss != "checkpoint",
                   compile_head=variant.loss == "fused-compiled")
    params = model.trainable_parameters()
    if variant.optim == "fused" and gpu:
        optim = build_adamw(params, 1e-4, fused=True)
    else:
        optim = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, foreach=True)
    batch = random_batch(cfg, t, records, torch.bfloat16 if gpu else torch.float32)
    # The trainer's path: each step's batch is copied into pinned memory on the loader thread (as collate
    # builds it there) and reaches the GPU a step ahead; the legacy path copies pageable memory in the step.
    batches = (BatchPrefetcher(lambda _: batch.pin_memory() if gpu else batch, range(10**9), device, ahead=variant.ahead)
               if variant.prefetch else None)

    def one_step() -> torch.Tensor:
        if variant.early_zero_grad:
            optim.zero_grad(set_to_none=True)
        b = next(batches) if batches is not None else batch.to(device)
        out = teacher(b, torch.bfloat16 if gpu else torch.float32)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu):
            loss, _ = ttt(b, out)
        if not variant.early_zero_grad:
            optim.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = clip_gradients(optim, params, 0.5)
        # One host read of loss and grad norm a step, as Trainer.train_step does (it skips non-finite steps).
        values = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float()]).tolist()
        optim.step()
        optim.grad_scale = None
        return torch.tensor(values[0])

    return one_step, (batches.close if batches is not None else (lambda: None))


TOP_KERNELS = 15  # rows of --profile tables (bench/specforge_training.py --top changes it)


def top_kernels(prof, device: torch.device, n: int | None = None) -> list[dict]:
    """The n CUDA kernels with the most total time (on CPU: the ops with the most self time)."""
    from torch.autograd import DeviceType

    rows = []
    for event in prof.key_averages():
        if device.type == "cuda":
            if event.device_type != DeviceType.CUDA:
                continue
            us = getattr(event, "device_time_total", None)
            us = event.cuda_time_total if us is None else us
        else:
            us = event.self_cpu_time_total
        rows.append({"name": event.key, "ms": us / 1e3, "calls": event.count})
    total = sum(r["ms"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["ms"])
    for r in rows:
        r["share"] = r["ms"] / total
    return rows[:n or TOP_KERNELS]


def profile_into(result: dict, one_step, device: torch.device) -> None:
    """result["kernels"]: the top kernels of one step; on CUDA also result["timeline"]: where its GPU time
    goes (kernel_timeline)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        one_step()
        _sync(device)
    result["kernels"] = top_kernels(prof, device)
    if device.type == "cuda":
        result["timeline"] = kernel_timeline([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                                              if e.device_type != DeviceType.CPU and not e.is_user_annotation])


KERNEL_FAMILIES = (  # first match wins
    ("gemm", ("nvjet", "gemm", "cutlass::Kernel", "sm90_xmma", "cublas")),
    ("attention", ("flash", "fmha", "attention")),
    ("optimizer", ("multi_tensor_apply", "Optimizer")),
    ("compiled (triton)", ("triton_",)),
    ("host-device copy", ("Memcpy HtoD", "Memcpy DtoH")),
    ("copy/cast", ("copy_kernel", "Memcpy", "Memset")),
    ("reduction", ("reduce_kernel", "Reduce")),
    ("elementwise", ("elementwise", "Functor")),
)
GAP_US = 5.0  # shorter gaps between kernels are launch latency, not idle


def kernel_family(name: str) -> str:
    return next((family for family, keys in KERNEL_FAMILIES if any(k in name for k in keys)), "other")


def kernel_timeline(kernels: list[tuple[str, float, float]], sites: int = 8) -> dict:
    """GPU time of one step by kernel family, the time no kernel ran on any stream (idle) between the
    first kernel's start and the last one's end, and the kernels that idle time waited before."""
    kernels = sorted((k for k in kernels if k[2] > k[1]), key=lambda k: k[1])
    families: dict[str, float] = {}
    for name, start, end in kernels:
        families[kernel_family(name)] = families.get(kernel_family(name), 0.0) + (end - start) / 1e3
    idle = 0.0
    before: dict[str, list[float]] = {}
    reach = kernels[0][2] if kernels else 0.0
    for name, start, end in kernels[1:]:
        if start - reach > GAP_US:
            idle += start - reach
            site = before.setdefault(name[:90], [0.0, 0])
            site[0] += (start - reach) / 1e3
            site[1] += 1
        reach = max(reach, end)
    span = (reach - kernels[0][1]) / 1e3 if kernels else 0.0
    top = sorted(before.items(), key=lambda kv: -kv[1][0])[:sites]
    return {"span_ms": span, "idle_ms": idle / 1e3, "families_ms": dict(sorted(families.items(), key=lambda kv: -kv[1])),
            "idle_before": [{"kernel": k, "ms": v[0], "gaps": v[1]} for k, v in top]}


def print_timeline(timeline: dict) -> None:
    busy = ", ".join(f"{name} {ms:.2f}" for name, ms in timeline["families_ms"].items())
    print(f"    GPU span {timeline['span_ms']:.2f} ms, idle {timeline['idle_ms']:.2f} ms (no kernel on any stream); "
          f"kernel ms by family: {busy}")
    for site in timeline["idle_before"]:
        print(f"      idle {site['ms']:7.2f} ms in {site['gaps']:4d} gaps before  {site['kernel']}")


def time_steps(one_step: Callable[[], torch.Tensor], device: torch.device, iters: int) -> tuple[float, dict]:
    """(first loss, timings) of `iters` steps after two warm-up steps (compiles, allocator; same seed, so
    sides compare). Each step ends in a host read of its loss, so one step's wall time is its own: the
    median shows the steady state where the mean can carry one slow step (a late recompile, a GC pause)."""
    first = float(one_step())
    one_step()
    _sync(device)
    walls = []
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(iters):
        before = time.perf_counter()
        one_step()
        walls.append(time.perf_counter() - before)
    _sync(device)
    seconds, walls = time.perf_counter() - start, sorted(walls)
    return first, {"step_s": seconds / iters, "cpu_s": (time.process_time() - cpu_start) / iters,  # all threads
                   "step_median_s": walls[len(walls) // 2], "step_max_s": walls[-1]}


def run_length(cfg: DraftConfig, t: int, steps: int, iters: int, backend: str, variant: Variant,
               device: torch.device, chunk_rows: int | None, profile: bool, records: int = 1) -> dict:
    gpu = device.type == "cuda"
    one_step, close = build(cfg, t, steps, backend, variant, device, chunk_rows, records)
    if gpu:  # the peak from here on: resident weights, optimizer state and the steps themselves
        torch.cuda.reset_peak_memory_stats(device)
    first_loss, times = time_steps(one_step, device, iters)
    result = {"tokens": t, "records": records, "variant": asdict(variant), **times,
              "tokens_per_s": records * t / times["step_s"], "tflops": records * model_flops(cfg, t, steps) / times["step_s"] / 1e12,
              "first_loss": first_loss, "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if gpu else None}
    if profile:
        profile_into(result, one_step, device)
    close()
    del one_step, close
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    return result


def format_row(r: dict, peak_tflops: float | None, tag: str) -> str:
    ref = SPECFORGE.get(r["tokens"]) if r.get("records", 1) == 1 and r.get("shape", "llama8b") == "llama8b" else None
    line = f"T={r['tokens']:6d} x{r.get('records', 1):<3d} {tag:14s} {r['tokens_per_s']:9.0f} tok/s ({r['step_s'] * 1e3:.1f} ms/step)"
    line += f"  {r['tokens_per_s'] / ref[0]:5.2f}x SpecForge (goal {GOAL:.2f}x)" if ref else "  (no SpecForge figure)"
    if r["peak_gib"] is not None:
        line += f"  peak {r['peak_gib']:5.1f} GiB"
        if ref:
            line += f" ({r['peak_gib'] - ref[1]:+5.1f} vs SpecForge {ref[1]:.1f})"
    else:
        line += "  peak n/a (CPU)"
    if peak_tflops:
        line += f"  {r['tflops']:6.1f} TFLOP/s ({100 * r['tflops'] / peak_tflops:4.1f}% of matmul)"
    if "step_median_s" in r:  # a mean well above the median: one slow step, not the steady state
        line += f"  steps median {r['step_median_s'] * 1e3:.1f} max {r['step_max_s'] * 1e3:.1f} ms"
    if "cpu_s" in r:
        line += f"  host CPU {r['cpu_s'] * 1e3:.1f} ms/step"
    return line + f"  loss0 {r['first_loss']:.5f}"


def print_kernels(rows: list[dict], gpu: bool) -> None:
    print(f"    top {len(rows)} {'CUDA kernels by total time' if gpu else 'CPU ops by self time'} (one step):")
    for r in rows:
        print(f"    {r['ms']:9.2f} ms {100 * r['share']:5.1f}% {r['calls']:6d}x  {r['name'][:110]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="default 2048 4096 16384")
    parser.add_argument("--steps", type=int, default=7, help="TTT steps")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--backend", default="flex", choices=["flex", "sdpa", "flash", "cudnn"])
    parser.add_argument("--loss", nargs="+", default=["fused"], choices=["fused", "fused-compiled", "checkpoint"],
                        help="one run per value, side by side")
    parser.add_argument("--batches", nargs="+", default=["prefetched"], choices=["prefetched", "prefetched-ahead", "pageable"],
                        help="the trainer's prefetcher (-ahead: copies one step earlier), or a pageable copy in the step")
    parser.add_argument("--optim", default="fused", choices=["fused", "foreach"])
    parser.add_argument("--embed", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--zero-grad", default="early", choices=["early", "late"])
    parser.add_argument("--chunk-rows", type=int, default=None, help="head-loss rows per chunk (default: auto)")
    parser.add_argument("--compare", action="store_true", help="also run the previous implementation")
    parser.add_argument("--profile", action="store_true", help="top 15 CUDA kernels of one step per length")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--json", default="")
    parser.add_argument("--shape", default="llama8b", choices=["llama8b", "e2e"],
                        help="drafter shape: Llama-3.1-8B's, or that of gpu_end_to_end.py's 80M target")
    parser.add_argument("--records", type=int, nargs="+", default=[1], help="records per step (padded batch)")
    args = parser.parse_args()
    variants = [(loss + ("" if b == "prefetched" else "/" + b),
                 Variant(loss, args.optim, args.embed, args.zero_grad == "early", b != "pageable", int(b == "prefetched-ahead")))
                for loss in args.loss for b in args.batches]
    if args.compare:
        variants.insert(0, ("old", LEGACY))
    if args.cpu_smoke:
        device, cfg = torch.device("cpu"), DraftConfig(**SMOKE_SHAPES)
        backend = args.backend if args.backend in ("sdpa", "flash", "cudnn") else "sdpa"  # flex is compiled for CUDA
        lengths, iters, peak = args.lengths or [64, 128], min(args.iters, 2), None
        print(f"CPU smoke  torch {torch.__version__}  tiny drafter (hidden {cfg.hidden_size}, draft vocab "
              f"{cfg.draft_vocab_size}): figures check that the script runs, nothing more; on the CPU "
              "the embedding stays fp32 and AdamW is not fused")
    else:
        if not torch.cuda.is_available():
            print("bench/training.py needs a CUDA GPU (or --cpu-smoke)")
            return 2
        device, cfg = torch.device("cuda"), DraftConfig(**(E2E_SHAPES if args.shape == "e2e" else SHAPES))
        lengths, backend, iters = args.lengths or [2048, 4096, 16384], args.backend, args.iters
        peak = matmul_tflops()
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 matmul {peak:.0f} TFLOP/s")
    for tag, v in variants:
        print(f"  {tag:14s} {v.label}")
    rows = []
    for t, records, (tag, v) in itertools.product(lengths, args.records, variants):
        try:
            r = run_length(cfg, t, args.steps, iters, backend, v, device, args.chunk_rows, args.profile, records)
            r["shape"] = args.shape
        except torch.OutOfMemoryError as exc:
            r = {"tokens": t, "records": records, "variant": asdict(v), "error": f"OOM: {str(exc).splitlines()[0]}"}
            torch.cuda.empty_cache()
        rows.append(r)
        if "error" in r:
            print(f"T={t:6d} x{records:<3d} {tag:14s} {r['error']}", flush=True)
            continue
        print(format_row(r, peak, tag), flush=True)
        if "kernels" in r:
            print_kernels(r["kernels"], device.type == "cuda")
            if "timeline" in r:
                print_timeline(r["timeline"])
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_tflops": peak, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
