"""This project's drafter trainer beside SpecForge's own, in one process, at the same shapes.

    python bench/specforge_training.py --specforge-src DIR [--lengths 2048 4096] [--iters 6]
                                       [--attention flex|sdpa] [--loss fused-compiled] [--profile [--top N]]
                                       [--sides ours ours/plain-autocast specforge] [--json PATH] [--cpu-smoke]

DIR is a SpecForge source checkout (sgl-project/SpecForge; measured at a6b6b02). Nothing of it is
copied here: its modules are imported from DIR. Its side is its offline EAGLE-3 step as its trainer
runs it: `TrainerCore.train_step` over `Eagle3TrainStrategy` (the frozen `TargetHead` re-run on the
stored final state, `OnlineEagle3Model` with 7 TTT steps, its Triton soft-CE loss, 0.8^k step
weights), `FSDPTrainingBackend` and `BF16Optimizer` (bf16 weights, fp32 AdamW masters, clip 0.5),
its draft `LlamaForCausalLMEagle3` built by `AutoDraftModel.from_config` in bf16 with the embedding
frozen, and a batch as its offline normalizer (`normalize_offline_sample`) lays it out, in pageable
host memory (its loader does not pin). The backend is prepared with wrap=False: on one GPU its
FSDP/DDP wrapper would only add work, so this is SpecForge's cheapest single-GPU step.

This project's side is bench/training.py's step (the trainer's own: TTTModel, fused AdamW, the
BatchPrefetcher). Both see the same random record (Llama-3.1-8B drafter shapes, batch 1) and the
same draft vocabulary; each side's peak is `max_memory_allocated` from after its model is built.
Prints tok/s, peak GiB and TFLOP/s per side and length, then the ratios; --profile adds the 15
CUDA kernels with the most time in one step of each side.

  --cpu-smoke   tiny shapes on the CPU: SpecForge's pieces import and one step of each side runs
                (SpecForge's Triton loss runs under TRITON_INTERPRET=1, set here); figures mean nothing
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

GOAL = 1.5


def _import_specforge(src: Path) -> dict[str, Any]:
    """SpecForge's trainer pieces, imported from the checkout at `src` (never vendored here)."""
    if not (src / "specforge" / "__init__.py").is_file():
        raise SystemExit(f"{src} is not a SpecForge checkout (no specforge/__init__.py): fetch "
                         "github:sgl-project/SpecForge and pass its directory with --specforge-src")
    sys.path.insert(0, str(src))
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy

    return dict(normalize_offline_sample=normalize_offline_sample, OnlineEagle3Model=OnlineEagle3Model,
                AutoDraftModel=AutoDraftModel, TargetHead=TargetHead, BF16Optimizer=BF16Optimizer,
                TrainBatch=TrainBatch, FSDPTrainingBackend=FSDPTrainingBackend, ParallelConfig=ParallelConfig,
                TrainerCore=TrainerCore, Eagle3TrainStrategy=Eagle3TrainStrategy)


def _write_target_head(folder: Path, cfg, weight: torch.Tensor) -> None:
    """A target directory holding only what SpecForge's TargetHead.from_pretrained reads: the config
    and the LM head in a safetensors shard named by an index."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=1).save_pretrained(folder)
    save_file({"lm_head.weight": weight.contiguous()}, str(folder / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "model.safetensors"}}))


def build_specforge(sf: dict[str, Any], cfg, t: int, ttt: int, attention: str, device: torch.device,
                    head: torch.Tensor, hot: torch.Tensor, workdir: Path) -> tuple[Callable[[], torch.Tensor], Callable[[], None]]:
    """SpecForge's model, strategy, backend, optimizer and one batch; returns its training step."""
    from transformers import LlamaConfig

    from bench.training import random_batch

    torch.manual_seed(0)
    fields: dict[str, Any] = dict(  # SpecForge's configs/llama3-8B-eagle3.json, at this bench's shapes
        architectures=["LlamaForCausalLMEagle3"], hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        num_hidden_layers=1, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        max_position_embeddings=max(2048, t + 2 * ttt), rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, hidden_act="silu", pad_token_id=0, tie_word_embeddings=False)
    draft_cfg = LlamaConfig(**fields)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    backend_name = {"flex": "flex_attention", "sdpa": "sdpa"}[attention]
    draft = sf["AutoDraftModel"].from_config(draft_cfg, attention_backend=backend_name, torch_dtype=dtype)
    with torch.no_grad():  # the same draft vocabulary as this project's side
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[hot] = True
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(hot - torch.arange(cfg.draft_vocab_size))
    draft.freeze_embedding()
    draft = draft.to(device=device, dtype=dtype)
    model = sf["OnlineEagle3Model"](draft_model=draft, length=ttt, attention_backend=backend_name).to(device=device, dtype=dtype)
    _write_target_head(workdir, cfg, head.to(torch.bfloat16).cpu())
    target_head = sf["TargetHead"].from_pretrained(str(workdir)).to(device=device, dtype=dtype)
    strategy = sf["Eagle3TrainStrategy"](model, target_head=target_head)
    backend = sf["FSDPTrainingBackend"](
        sf["ParallelConfig"](), optimizer_factory=lambda m: sf["BF16Optimizer"](m, lr=1e-4, max_grad_norm=0.5, total_steps=10**6))
    backend.prepare_model(model, wrap=False)
    core = sf["TrainerCore"](strategy, backend)
    record = random_batch(cfg, t, 1, dtype)
    raw = {"input_ids": record.input_ids[0], "loss_mask": record.loss_mask[0].long(),
           "aux_hidden_state": record.aux, "hidden_state": record.hidden}
    tensors = sf["normalize_offline_sample"](raw, max_len=t)
    batch = sf["TrainBatch"](sample_ids=["0"], strategy="eagle3", tensors=tensors, metadata={"target_repr": "hidden_state"})

    def one_step() -> torch.Tensor:
        return torch.tensor(core.train_step(batch).loss)  # a float: its step reads it back, as ours does

    def close() -> None:
        nonlocal core, backend, strategy, model, draft, target_head
        del core, backend, strategy, model, draft, target_head

    return one_step, close


def run_specforge(sf, cfg, t: int, ttt: int, attention: str, device: torch.device, iters: int, profile: bool) -> dict:
    from bench.training import model_flops, profile_into, time_steps

    gpu = device.type == "cuda"
    torch.manual_seed(0)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    hot = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
    with tempfile.TemporaryDirectory(prefix="sf-target-") as tmp:
        one_step, close = build_specforge(sf, cfg, t, ttt, attention, device, head, hot, Path(tmp))
    del head
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    first, times = time_steps(one_step, device, iters)
    seconds = times["step_s"]
    result = {"side": "specforge", "tokens": t, **times, "tokens_per_s": t / seconds,
              "tflops": model_flops(cfg, t, ttt) / seconds / 1e12, "first_loss": first,
              "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if gpu else None}
    if profile:
        profile_into(result, one_step, device)
    close()
    del one_step, close
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    return result


VARIANT_ENV = {  # ours/VARIANT sides that are an earlier path of the trainer, chosen by its A/B switches
    "plain-autocast": {"EAGLE3_TRAIN_PLAIN_AUTOCAST": "1"},
    "separate-projections": {"EAGLE3_TRAIN_SEPARATE_PROJECTIONS": "1"},
    "all-dynamic": {"EAGLE3_TRAIN_COMPILE_DYNAMIC": "all"},
}


def run_ours(cfg, t: int, ttt: int, attention: str, device: torch.device, iters: int, profile: bool, loss: str,
             batches: str = "prefetched") -> dict:
    from bench.training import Variant, run_length

    variant = Variant(loss, prefetch=batches != "pageable", ahead=int(batches == "prefetched-ahead"))
    switches = {"EAGLE3_TRAIN_PLAIN_AUTOCAST": "0", "EAGLE3_TRAIN_SEPARATE_PROJECTIONS": "0",
                "EAGLE3_TRAIN_COMPILE_DYNAMIC": "automatic",
                **VARIANT_ENV.get(batches, {})}
    previous = {name: os.environ.get(name) for name in switches}
    os.environ.update(switches)
    try:
        r = run_length(cfg, t, ttt, iters, attention, variant, device, None, profile)
    finally:
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    r["side"] = "ours" if batches == "prefetched" else f"ours/{batches}"
    return r


OUR_VARIANTS = ("prefetched", "prefetched-ahead", "pageable", "plain-autocast", "separate-projections", "all-dynamic")
OUR_BACKENDS = ("flex", "sdpa", "flash", "cudnn")


def side_name(text: str) -> str:
    """argparse type of --sides: 'specforge' or ours[/VARIANT][@BACKEND]."""
    name, _, backend = text.partition("@")
    base, _, variant = name.partition("/")
    ours = base == "ours" and variant in ("", *OUR_VARIANTS) and backend in ("", *OUR_BACKENDS)
    if text == "specforge" or (ours and not text.endswith(("/", "@"))):
        return text
    raise argparse.ArgumentTypeError(f"unknown side {text!r}: use specforge or ours[/VARIANT][@BACKEND] with VARIANT one "
                                     f"of {', '.join(OUR_VARIANTS)} and BACKEND one of {', '.join(OUR_BACKENDS)}")


def describe_process() -> str:
    """What else runs in this process (threads an import left behind, dynamo's limits): at 2,048 tokens
    the step is close to host-bound, so another thread taking the GIL shows in its time."""
    import threading

    names = sorted(thread.name for thread in threading.enumerate() if thread is not threading.main_thread())
    return (f"{len(names)} other Python threads {names[:8]}; dynamo recompile_limit "
            f"{torch._dynamo.config.recompile_limit}; torch threads {torch.get_num_threads()}")


def describe(r: dict, peak_tflops: float | None) -> str:
    line = f"T={r['tokens']:6d} {r['side']:22s} {r['tokens_per_s']:9.0f} tok/s ({r['step_s'] * 1e3:7.1f} ms/step)"
    if "step_median_s" in r:  # a mean well above the median: one slow step, not the steady state
        line += f"  steps median {r['step_median_s'] * 1e3:.1f} max {r['step_max_s'] * 1e3:.1f} ms"
    line += f"  peak {r['peak_gib']:5.1f} GiB" if r["peak_gib"] is not None else "  peak n/a (CPU)"
    if peak_tflops:
        line += f"  {r['tflops']:6.1f} TFLOP/s ({100 * r['tflops'] / peak_tflops:4.1f}% of matmul)"
    if "cpu_s" in r:
        line += f"  host CPU {r['cpu_s'] * 1e3:.1f} ms/step"
    return line + f"  loss0 {r['first_loss']:.5f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specforge-src", type=Path, required=True, help="a SpecForge source checkout")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="default 2048 4096")
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--attention", default="flex", choices=["flex", "sdpa"],
                        help="both sides (ours@BACKEND sides choose their own)")
    parser.add_argument("--loss", default="fused-compiled", choices=["fused", "fused-compiled", "checkpoint"],
                        help="this project's loss head (fused-compiled: the trainer's default on CUDA)")
    parser.add_argument("--sides", nargs="+", default=["ours", "specforge"],
                        type=side_name, metavar="ours[/VARIANT][@BACKEND]|specforge",
                        help="ours/pageable: this project's step copying a pageable batch inside the step (before "
                             "session 10); ours/prefetched-ahead: BatchPrefetcher(ahead=1); ours/plain-autocast: "
                             "EAGLE3_TRAIN_PLAIN_AUTOCAST=1, the mixed precision before engine.train.mixed; ours/separate-projections: "
                             "EAGLE3_TRAIN_SEPARATE_PROJECTIONS=1, q/k/v and gate/up as separate GEMMs; "
                             "ours@BACKEND: our step with that attention backend (SpecForge keeps --attention)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=15, help="kernels listed per --profile table")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import bench.training
    from bench.training import SHAPES, SMOKE_SHAPES, matmul_tflops, print_kernels, print_timeline
    from engine.train.model import DraftConfig

    bench.training.TOP_KERNELS = args.top

    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels on the CPU
        device, cfg, attention = torch.device("cpu"), DraftConfig(**SMOKE_SHAPES), "sdpa"
        lengths, iters, peak = args.lengths or [64], 1, None
        print("CPU smoke: tiny shapes, SDPA, figures check that both sides run, nothing more")
    else:
        if not torch.cuda.is_available():
            print("bench/specforge_training.py needs a CUDA GPU (or --cpu-smoke)")
            return 2
        device, cfg, attention = torch.device("cuda"), DraftConfig(**SHAPES), args.attention
        lengths, iters = args.lengths or [2048, 4096], args.iters
        peak = matmul_tflops()
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 matmul {peak:.0f} TFLOP/s")
    sf = _import_specforge(args.specforge_src.resolve()) if "specforge" in args.sides else None
    print(f"ours: bench/training.py step, loss={args.loss}, prefetched batches; specforge: TrainerCore + "
          f"Eagle3TrainStrategy + BF16Optimizer from {args.specforge_src}; attention {attention}; TTT {args.ttt}; batch 1",
          flush=True)
    rows = []
    for t in lengths:
        pair = {}
        for side in args.sides:
            print(f"    before {side}: {describe_process()}", flush=True)
            try:
                if side.startswith("ours"):
                    name, _, our_attention = side.partition("@")
                    r = run_ours(cfg, t, args.ttt, our_attention or attention, device, iters, args.profile, args.loss,
                                 name.partition("/")[2] or "prefetched")
                    r["side"] = side
                else:
                    r = run_specforge(sf, cfg, t, args.ttt, attention, device, iters, args.profile)
            except RuntimeError as exc:  # OOM, or a kernel this GPU lacks: the other sides still run
                kind = "OOM" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
                r = {"side": side, "tokens": t, "error": f"{kind}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                torch.cuda.empty_cache()
            rows.append(r)
            if "error" in r:
                print(f"T={t:6d} {side:22s} {r['error']}", flush=True)
                continue
            pair[side] = r
            print(describe(r, peak), flush=True)
            if "kernels" in r:
                print_kernels(r["kernels"], device.type == "cuda")
            if "timeline" in r:
                print_timeline(r["timeline"])
        theirs = pair.get("specforge")
        for side, ours in pair.items() if theirs else ():
            if side == "specforge":
                continue
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
            line = f"T={t:6d} ratio {side:28s} {ratio:5.2f}x SpecForge's tok/s (goal {GOAL:.2f}x)"
            if ours["peak_gib"] is not None:
                line += f"  peak {ours['peak_gib'] - theirs['peak_gib']:+5.2f} GiB vs SpecForge"
            print(line, flush=True)
    from engine.train import mixed

    fallbacks = {"compiled_kernels": mixed._BROKEN, "fp32_gemm": mixed.FP32_GEMM_BROKEN}
    print(f"ours' fallbacks (empty: the fused paths ran): {fallbacks}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_tflops": peak, "rows": rows, "fallbacks": fallbacks}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
