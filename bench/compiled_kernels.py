"""The training step's compiled elementwise kernels, one at a time, at Llama-3.1-8B drafter shapes: eager
against torch.compile with every dimension symbolic (dynamic=True, what compiled_or_eager did) and against
automatic dynamic shapes (dynamic=None: after a second record length only the dimensions that changed are
symbolic, the model's widths stay constants). Side by side in one run; GB/s counts each kernel's
necessary bytes (inputs read once, outputs written once) against the device's copy rate.

    python bench/compiled_kernels.py [--tokens 4096] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.train import mixed  # noqa: E402
from engine.train.data import _draft_softmax  # noqa: E402
from engine.train.loss import _chunk_logits_pass, fused_chunk_rows  # noqa: E402
from engine.train.model import _rope_qk, rope_cos_sin  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, DRAFT_VOCAB, VOCAB = 4096, 14336, 32, 8, 128, 32000, 128256


def _time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_rate_gbs(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _time_ms(lambda: dst.copy_(src), 20) / 1e6


def cases(t: int) -> dict:
    """name -> (function, inputs maker for a record length, bytes read and written at length t)."""
    bf = torch.bfloat16

    def swiglu_in(n):
        return (torch.randn(n, 2 * INTERMEDIATE, device="cuda", dtype=bf),)

    def swiglu_back_in(n):
        return torch.randn(n, INTERMEDIATE, device="cuda", dtype=bf), *swiglu_in(n)

    def rms_in(n):
        return torch.randn(n, HIDDEN, device="cuda", dtype=bf), torch.ones(HIDDEN, device="cuda"), 1e-5, bf

    def rms_back_in(n):
        x, w, _, _ = rms_in(n)
        return torch.randn(n, HIDDEN, device="cuda", dtype=bf), x, w, torch.rand(n, 1, device="cuda") + 0.5

    def rope_in(n):
        qk = torch.randn(1, n, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=bf)
        q = qk[..., :HEADS * HEAD_DIM].view(1, n, HEADS, HEAD_DIM).transpose(1, 2)
        k = qk[..., HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(1, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
        cos, sin = rope_cos_sin(torch.arange(n, device="cuda"), HEAD_DIM, 500000.0, bf)
        return q, k, cos, sin

    def head_chunk_in(n):  # one chunk of the loss head: its rows do not depend on the record length
        rows = fused_chunk_rows(DRAFT_VOCAB)
        q = torch.softmax(torch.randn(rows, DRAFT_VOCAB, device="cuda"), -1).to(bf)
        ones = torch.ones(rows, device="cuda")
        return (torch.randn(rows, HIDDEN, device="cuda", dtype=bf), torch.randn(DRAFT_VOCAB, HIDDEN, device="cuda",
                dtype=bf) * 0.02, q, q.float().sum(-1), ones, ones / rows,
                torch.randint(0, DRAFT_VOCAB, (rows,), device="cuda"), ones.bool(), torch.float32, bf, True)

    def teacher_in(n):  # the target head's full-vocabulary logits of n rows, the draft vocabulary's columns
        hot = torch.sort(torch.randperm(VOCAB, device="cuda")[:DRAFT_VOCAB]).values
        return torch.randn(n, VOCAB, device="cuda", dtype=bf), hot, bf

    i, h, qk = INTERMEDIATE, HIDDEN, (HEADS + KV_HEADS) * HEAD_DIM  # bf16 elements: 2 bytes each
    v, chunk = DRAFT_VOCAB, fused_chunk_rows(DRAFT_VOCAB)
    return {
        "swiglu forward": (mixed._swiglu_forward, swiglu_in, t * 2 * (2 * i + i)),
        "swiglu backward": (mixed._swiglu_backward, swiglu_back_in, t * 2 * (i + 2 * i + 2 * i)),
        "rms_norm forward": (mixed._rms_forward, rms_in, t * (2 * 2 * h + 4)),
        "rms_norm backward": (mixed._rms_backward, rms_back_in, t * (3 * 2 * h + 4) + 4 * h),
        "rope q,k": (_rope_qk, rope_in, t * 2 * 2 * qk),
        # The logits GEMM is inside it; bytes: logits written and read back, q read, the gradient written.
        "loss head chunk": (_chunk_logits_pass, head_chunk_in, chunk * v * 2 * 4),
        # The draft columns read once (gathered), the bf16 distribution written once.
        "teacher draft softmax": (_draft_softmax, teacher_in, t * v * 2 * 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--only", nargs="+", metavar="WORD", help="just the kernels whose name holds one of these")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch._dynamo.config.cache_size_limit = 64
    rate = copy_rate_gbs()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  device copy {rate:,.0f} GB/s  T={args.tokens}")
    print(f"{'kernel':<20} {'eager ms':>9} {'dynamic=True':>13} {'automatic':>10}   GB/s eager / True / automatic"
          "   automatic x eager")
    for name, (fn, make, nbytes) in cases(args.tokens).items():
        if args.only and not any(word in name for word in args.only):
            continue
        inputs = make(args.tokens)
        compiled_all = torch.compile(fn, dynamic=True)
        compiled_auto = torch.compile(fn)
        compiled_auto(*make(args.tokens // 2))  # a second length: its changed dimension becomes symbolic
        ms = [_time_ms(lambda f=f: f(*inputs), args.iters) for f in (fn, compiled_all, compiled_auto)]
        gbs = [nbytes / m / 1e6 for m in ms]
        print(f"{name:<20} {ms[0]:>9.3f} {ms[1]:>13.3f} {ms[2]:>10.3f}   "
              f"{gbs[0]:>6,.0f} / {gbs[1]:,.0f} / {gbs[2]:,.0f}   {ms[0] / ms[2]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
