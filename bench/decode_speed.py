"""Decode speed of the evaluation's target paths and of one drafter step, side by side.

    python bench/decode_speed.py [--size tiny|88m] [--tokens 128] [--prompt-len 32] [--steps 3]

A random-init Llama (tiny: 4 layers, hidden 64; 88m: 12 layers, hidden 768, intermediate 2048,
12 heads, 4 KV heads, vocab 8192) on CUDA in bf16 when available, else on CPU in float32, and a
random Eagle3Drafter of matching shape. Prints in one run:

- greedy tokens/s of transformers' forward with a DynamicCache (EAGLE3_EVAL_FAST=0) and of the
  lean runner (engine.evaluate.fastllama), and their ratio (both outputs must be equal);
- milliseconds of one target step (1 token), one verify step (steps+1 tokens) and one drafter
  step (extend + propose, no host sync), and the drafter/target step ratio;
- the speedup those step times allow at acceptance length 2.5 (tokens per verify step):
  2.5 * target_step / (verify + steps * drafter_step + extend), an estimate, not a measurement;
- on CUDA: verify at advancing positions and end-to-end speculative decoding with cuDNN attention
  on/off and with a boolean mask vs the lower-right causal bias; the local server's prefill
  (transformers, padded batch) with cuDNN attention on/off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.evaluate import fastllama  # noqa: E402
from engine.evaluate.fastllama import FAST_ENV, try_fast_target  # noqa: E402
from engine.evaluate.specdec import DraftRunner, greedy_decode, speculative_decode  # noqa: E402
from engine.train.model import DraftConfig, Eagle3Drafter  # noqa: E402

SIZES = {
    "tiny": dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "88m": dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                num_attention_heads=12, num_key_value_heads=4),
    # the shape gpu_end_to_end.py trains (16 layers, hidden 640, 10 heads over 2 KV heads)
    "e2e": dict(vocab_size=16384, hidden_size=640, intermediate_size=1728, num_hidden_layers=16,
                num_attention_heads=10, num_key_value_heads=2),
}


def build_target(size: str, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, **SIZES[size])
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than default init, so greedy output is not one repeated token
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.1)
    return model.to(device=device, dtype=dtype).eval()


def build_drafter(target, dtype: torch.dtype) -> Eagle3Drafter:
    cfg = target.config
    layers = cfg.num_hidden_layers
    dcfg = DraftConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
                       vocab_size=cfg.vocab_size, draft_vocab_size=min(cfg.vocab_size, 4096),
                       rms_norm_eps=cfg.rms_norm_eps, aux_layers_sglang=[1, layers // 2, layers - 1])
    torch.manual_seed(1)
    drafter = Eagle3Drafter(dcfg)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return drafter.to(device=target.device, dtype=dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_rate(target, prompt: list[int], tokens: int, repeats: int, fast: bool) -> tuple[float, list[int]]:
    os.environ[FAST_ENV] = "1" if fast else "0"
    try:
        greedy_decode(target, prompt, min(tokens, 8))  # warm-up
        runs = [greedy_decode(target, prompt, tokens) for _ in range(repeats)]
    finally:
        os.environ.pop(FAST_ENV, None)
    return statistics.median(len(r.tokens) / r.seconds for r in runs), runs[0].tokens


@torch.inference_mode()
def step_ms(fn, device: torch.device, iters: int) -> float:
    """Mean milliseconds of `fn()` over `iters` back-to-back calls, one sync at the end."""
    for _ in range(3):
        fn()
    sync(device)
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - started) / iters * 1e3


@torch.inference_mode()
def moving_verify_ms(runner, block: torch.Tensor, start: int, steps: int, aux: list[int]) -> float:
    """Mean ms of verify forwards at advancing positions, as decoding runs them: every step sees a
    new key length (the fixed-position timing above cannot show per-shape costs)."""
    device = block.device
    sync(device)
    started = time.perf_counter()
    for i in range(steps):
        runner.forward(block, start + i * block.shape[1], aux, all_logits=True)
    sync(device)
    return (time.perf_counter() - started) / steps * 1e3


MASKED_ROWS = (  # name, cuDNN attention allowed, lower-right causal bias for multi-token steps
    ("cudnn_on_mask", True, False), ("cudnn_off_mask", False, False), ("cudnn_off_lower_right", False, True))


def masked_attention_comparison(target, drafter, runner, prompt: list[int], block: torch.Tensor, args) -> dict:
    """Masked steps (verify, draft extend) with cuDNN attention allowed or not, and with an explicit
    boolean mask vs the lower-right causal bias (flash): side by side in this run."""
    if not hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        return {}
    aux = list(drafter.cfg.aux_layers_sglang)
    rows = {}
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for name, cudnn_allowed, lower_right in MASKED_ROWS:
            torch.backends.cuda.enable_cudnn_sdp(cudnn_allowed)
            fastllama.LOWER_RIGHT_CAUSAL = lower_right
            verify = moving_verify_ms(runner, block, len(prompt) + 1, 64, aux)
            speculative_decode(target, drafter, prompt, 8, args.steps, aux)  # warm-up
            spec = speculative_decode(target, drafter, prompt, args.tokens, args.steps, aux)
            rows[name] = {
                "verify_moving_ms": round(verify, 3),
                "spec_tok_s": round(len(spec.tokens) / spec.seconds, 1),
                "spec_ms_per_verify": round(spec.seconds / max(spec.verify_steps, 1) * 1e3, 3)}
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            torch.backends.cuda.enable_cudnn_sdp(False)
            fastllama.LOWER_RIGHT_CAUSAL = True
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if block.is_cuda else [])
            with profile(activities=activities) as prof:
                speculative_decode(target, drafter, prompt, 32, args.steps, aux)
            args.profile.write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
        fastllama.LOWER_RIGHT_CAUSAL = True
    return {"enabled_by_default": before, "rows": rows}


@torch.inference_mode()
def prefill_comparison(target, batch: int, length: int, rounds: int = 3) -> dict:
    """The local server's prefill (transformers forward, right-padded batch with an attention mask)
    with cuDNN attention allowed vs off, alternating: equal lengths, and lengths spread over half..full."""
    if not torch.cuda.is_available():
        return {}
    device = target.device
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(10, target.config.vocab_size, (batch, length), generator=gen).to(device)
    mixed_lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    mixed_lengths[0] = length
    masks = {"equal": torch.ones(batch, length, dtype=torch.long, device=device),
             "mixed": (torch.arange(length)[None, :] < mixed_lengths[:, None]).long().to(device)}
    before = torch.backends.cuda.cudnn_sdp_enabled()
    times: dict = {}
    try:
        for _ in range(rounds):
            for allowed in (True, False):
                torch.backends.cuda.enable_cudnn_sdp(allowed)
                for kind, mask in masks.items():
                    target(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)  # warm-up
                    sync(device)
                    started = time.perf_counter()
                    for _ in range(5):
                        target(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
                    sync(device)
                    tokens = int(mask.sum()) * 5
                    times.setdefault((kind, allowed), []).append(tokens / (time.perf_counter() - started))
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    out = {"batch": batch, "length": length}
    for kind in masks:
        on, off = max(times[(kind, True)]), max(times[(kind, False)])
        out[kind] = {"cudnn_on_tok_s": round(on), "cudnn_off_tok_s": round(off), "off_over_on": round(off / on, 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per greedy decode")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="draft tokens per verify step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=200, help="calls per step timing")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (tiny models run best on one)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--profile", type=Path, help="torch.profiler table of one speculative decode (as the "
                        "evaluation runs it: cuDNN off, lower-right causal)")
    parser.add_argument("--prefill-batch", type=int, default=8, help="server prefill comparison: batch (CUDA only)")
    parser.add_argument("--prefill-len", type=int, default=512, help="server prefill comparison: prompt tokens")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = build_target(args.size, str(device), dtype)
    drafter = build_drafter(target, dtype)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(2)).tolist()

    hf_rate, hf_tokens = greedy_rate(target, prompt, args.tokens, args.repeats, fast=False)
    fast_rate, fast_tokens = greedy_rate(target, prompt, args.tokens, args.repeats, fast=True)
    same = hf_tokens == fast_tokens
    first_diff = next((i for i, (a, b) in enumerate(zip(hf_tokens, fast_tokens)) if a != b), None)

    runner = try_fast_target(target)
    if runner is None:
        raise SystemExit("the fast runner refused this target")
    k = args.steps
    context = args.prompt_len + args.tokens // 2  # a mid-decode cache length
    runner.reserve(context + k + 2)
    one = torch.tensor([[prompt[0]]], device=device)
    block = torch.tensor([prompt[: k + 1]], device=device)
    filler = torch.tensor([(prompt * (context // len(prompt) + 1))[:context]], device=device)
    with torch.inference_mode():
        runner.forward(filler, 0)
    aux = list(drafter.cfg.aux_layers_sglang)
    target_ms = step_ms(lambda: runner.forward(one, context), device, args.iters)
    verify_ms = step_ms(lambda: runner.forward(block, context, aux, all_logits=True), device, args.iters)

    with torch.inference_mode():
        draft = DraftRunner(drafter, context + args.iters + 16)
        feature = torch.randn(1, context, drafter.cfg.hidden_size, device=device, dtype=dtype)
        hidden = draft.extend(filler, feature)[:, -1:]

    def draft_step():
        draft.crop(context)  # the same cache length every call
        draft.extend(draft.propose_token(hidden), hidden)

    def draft_extend():  # the "draft extend" after a verify: ~2.5 accepted positions
        draft.crop(context)
        draft.extend(block[:, :3], feature[:, :3])

    drafter_ms = step_ms(draft_step, device, args.iters)
    extend_ms = step_ms(draft_extend, device, args.iters)
    estimate = 2.5 * target_ms / (verify_ms + k * drafter_ms + extend_ms)
    cudnn = masked_attention_comparison(target, drafter, runner, prompt, block, args)
    prefill = prefill_comparison(target, args.prefill_batch, args.prefill_len)

    figures = {
        "size": args.size, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "hf_greedy_tok_s": round(hf_rate, 1), "fast_greedy_tok_s": round(fast_rate, 1),
        "fast_over_hf": round(fast_rate / hf_rate, 2), "outputs_equal": same, "first_difference": first_diff,
        "target_step_ms": round(target_ms, 3), "verify_step_ms": round(verify_ms, 3),
        "drafter_step_ms": round(drafter_ms, 3), "draft_extend_ms": round(extend_ms, 3),
        "drafter_over_target_step": round(drafter_ms / target_ms, 2),
        "estimated_speedup_at_accept_2_5": round(estimate, 2), "masked_attention": cudnn,
        "server_prefill_cudnn": prefill,
    }
    print(f"decode speed, {args.size} target on {figures['device']} ({figures['dtype']}), prompt "
          f"{args.prompt_len}, {args.tokens} new tokens, {k} draft steps")
    print(f"  greedy, transformers + DynamicCache : {hf_rate:9.1f} tok/s")
    print(f"  greedy, lean runner + static cache  : {fast_rate:9.1f} tok/s   ({fast_rate / hf_rate:.2f}x, "
          f"outputs {'equal' if same else f'differ at {first_diff}'})")
    print(f"  target step (1 token)               : {target_ms:9.3f} ms")
    print(f"  target verify ({k + 1} tokens)            : {verify_ms:9.3f} ms")
    print(f"  drafter step (extend + propose)     : {drafter_ms:9.3f} ms   "
          f"({drafter_ms / target_ms:.2f}x a target step)")
    print(f"  draft extend (3 accepted tokens)    : {extend_ms:9.3f} ms")
    print(f"  speedup these allow at accept 2.5   : {estimate:9.2f}x   (estimate)")
    for name, row in cudnn.get("rows", {}).items():
        print(f"  {name:9s}: verify at moving positions {row['verify_moving_ms']:8.3f} ms, speculative "
              f"decode {row['spec_tok_s']:8.1f} tok/s ({row['spec_ms_per_verify']:.3f} ms per verify step)")
    if cudnn:
        print(f"  cuDNN attention enabled by default: {cudnn['enabled_by_default']}")
    for kind in ("equal", "mixed"):
        if kind in prefill:
            row = prefill[kind]
            print(f"  server prefill {prefill['batch']} x {prefill['length']} ({kind} lengths): cuDNN on "
                  f"{row['cudnn_on_tok_s']:,} tok/s, off {row['cudnn_off_tok_s']:,} tok/s (off/on {row['off_over_on']})")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
