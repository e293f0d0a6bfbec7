"""Where a local-server prefill's time goes: the server's own forward (ModelRunner._forward), timed
and profiled side by side in one run, with the variants that could make it cheaper.

For each variant: ms per forward with the GPU drained after each (what a batch costs), ms for the
host to return from the call (launch time; equal to the first when something inside syncs), and
the GPU's busy share of the wall time under torch.profiler (kernel time / wall). A busy share far
below 1 with launch ms close to forward ms means the forward is bound by the host, not the GPU.

    python bench/prefill_profile.py --size e2e --batch 8 --length 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_variant(runner, torch, batch: int, length: int, use_cache: bool, mask_kind: str, repeats: int) -> dict:
    device = runner.device
    on_gpu = device.startswith("cuda")

    def drain():
        if on_gpu:
            torch.cuda.synchronize()

    ids = torch.randint(3, runner.info.vocab_size, (batch, length), device=device)
    mask = torch.ones((batch, length), dtype=torch.long, device=device)
    if mask_kind == "padded":
        mask[1:, length - length // 4:] = 0  # mixed lengths, as extraction sends them
    positions = torch.arange(length, device=device).unsqueeze(0).expand(batch, -1)
    keep = torch.tensor([length - 1], device=device) if runner.info.has_logits_to_keep else None

    def forward():
        kwargs = {"input_ids": ids, "attention_mask": None if mask_kind == "none" else mask,
                  "position_ids": positions, "use_cache": use_cache}
        if keep is not None:
            kwargs["logits_to_keep"] = keep
        return runner.model(**kwargs)

    with torch.inference_mode():
        for _ in range(3):
            forward()
        drain()
        launch, total = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            out = forward()
            launch.append((time.perf_counter() - start) * 1e3)
            drain()
            total.append((time.perf_counter() - start) * 1e3)
            del out
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(5):
                forward()
            drain()
            wall_us = (time.perf_counter() - start) * 1e6
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    syncs = sum(e.count for e in events if e.key in ("aten::_local_scalar_dense", "cudaStreamSynchronize"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {"use_cache": use_cache, "mask": mask_kind, "forward_ms": round(statistics.median(total), 2),
            "launch_ms": round(statistics.median(launch), 2), "gpu_busy": round(kernel_us / wall_us, 3),
            "tok_s": round(batch * length / statistics.median(total) * 1e3),
            "sync_like_calls_per_forward": round(syncs / 5, 1),
            "top_host_ops": [(e.key, e.count // 5, round(e.self_cpu_time_total / 5 / 1e3, 2)) for e in top]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="e2e")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available()  # CPU: a smoke run of the script, not a figure
    dtype = "bfloat16" if gpu else "float32"
    from capture_overhead import build_model
    from engine.localserver.model_runner import ModelRunner

    model_dir, params = build_model(args.size, Path(tempfile.mkdtemp(prefix="prefill-prof-")) / "model", dtype)
    runner = ModelRunner(model_dir, device="cuda" if gpu else "cpu", dtype=dtype)
    runner.load()
    rows = [run_variant(runner, torch, args.batch, args.length, cache, mask, args.repeats)
            for cache, mask in [(True, "padded"), (True, "ones"), (False, "padded"), (False, "ones"), (False, "none")]]
    print(json.dumps({"device": torch.cuda.get_device_name(0) if gpu else "CPU", "params": params, "batch": args.batch,
                      "length": args.length, "variants": rows}, indent=1))
    print(f"\n{'use_cache':>9} {'mask':>7} {'forward ms':>10} {'launch ms':>9} {'GPU busy':>8} {'tok/s':>10}")
    for row in rows:
        print(f"{row['use_cache']!s:>9} {row['mask']:>7} {row['forward_ms']:>10} {row['launch_ms']:>9} "
              f"{row['gpu_busy']:>8} {row['tok_s']:>10,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
