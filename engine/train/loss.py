"""The training-time-test forward: 7 unrolled steps, soft cross-entropy against the teacher,
per-step accuracy and expected acceptance. See engine.train.data for the alignment.

Two implementations of the head loss (final norm -> lm_head -> soft cross-entropy):
  fused       (default) `_FusedHeadLoss`: one pass per row chunk computes the loss, the statistics
              and the gradients of h, norm.weight and lm_head.weight; backward only scales them.
              The [rows, draft_vocab] logits are built once, and rows outside the accuracy mask
              (prompt tokens, padding) are skipped. compile_head=True runs the softmax part of each
              chunk through torch.compile (fewer full passes over [rows, vocab]; on by default on
              CUDA: loop.compile_head_wanted).
  checkpoint  the reference: autograd through `_chunk_stats`, recomputed in backward by
              torch.utils.checkpoint (logits built twice).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from engine.train.attention import DEFAULT_BACKEND
from engine.train.data import Batch, TeacherOut
from engine.train.mixed import accumulate_fp32, autocast_dtype, compiled_or_eager, no_autocast, step_weights
from engine.train.model import Eagle3Drafter, shift_left

STAT_FIELDS = ("loss_sum", "positions", "correct", "scored", "accept_sum", "entropy_sum")
STEP_DECAY = 0.8  # TTT step k weighs STEP_DECAY ** k in the total loss
CHECKPOINT_CHUNK_ROWS = 4096
FUSED_CHUNK_ELEMENTS = 1 << 26  # rows x draft_vocab per chunk: 256 MiB per fp32 [rows, vocab] buffer


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics run in fp32 at least (fp64 stays fp64, so CPU tests can compare tightly)."""
    return torch.promote_types(dtype, torch.float32)


def fused_chunk_rows(vocab: int) -> int:
    """Rows per fused chunk: a fixed logits budget, a multiple of 128 rows (GEMM-friendly)."""
    return max(128, (FUSED_CHUNK_ELEMENTS // max(1, vocab)) // 128 * 128)


def head_compute_dtype(device: torch.device, h_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The dtype autocast would run the head matmul in (bf16 under GPU autocast, else the inputs' dtype)."""
    return autocast_dtype(device.type) or torch.promote_types(h_dtype, w_dtype)


def _chunk_stats(h, norm_w, eps, head_w, probs, target, pos_mask, acc_mask):
    """Loss sum over pos_mask, correct greedy guesses over acc_mask, sum of min(p, q) over pos_mask."""
    acc = _acc_dtype(h.dtype)
    x = h.to(acc)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = (norm_w * x.to(h.dtype))
    logits = (x @ head_w.T).to(acc)
    logp = torch.log_softmax(logits, -1)
    q = probs.to(acc)
    w = pos_mask.to(acc)
    loss = -((q * logp).sum(-1) * w).sum()
    with torch.no_grad():
        correct = ((logits.argmax(-1) == target) & acc_mask).sum().to(acc)
        accept = (torch.minimum(logp.exp(), q).sum(-1) * w).sum()
        entropy = (-(q * torch.log(q.clamp(min=1e-30))).sum(-1) * w).sum()  # loss - entropy = KL(teacher||draft)
    return loss, correct, accept, entropy


# ---------------------------------------------------------------------------------------- fused


class StepRows(NamedTuple):
    """One TTT step's scored rows, flattened to [rows, ...]."""

    k: int  # the step: weighs STEP_DECAY ** k
    h: torch.Tensor  # [rows, H] pre-norm output of the step (differentiable)
    probs: torch.Tensor  # [rows, Vd] teacher distribution
    target: torch.Tensor  # [rows] draft id of the target's greedy token, -1 outside the draft vocab
    pos_mask: torch.Tensor  # [rows] rows with a loss
    acc_mask: torch.Tensor  # [rows] rows scored for accuracy (a superset of pos_mask)
    q_sum: torch.Tensor  # [rows] sum of the teacher row (not exactly 1 in bf16)
    entropy: torch.Tensor  # [rows] teacher entropy
    chunks: tuple  # the rows of acc_mask in chunks (slice or device indices: row_chunks, no device read)


TENSOR_FIELDS = StepRows._fields[1:-1]


@torch.no_grad()
def teacher_row_stats(probs: torch.Tensor, dtype: torch.dtype, chunk_rows: int):
    """Per teacher row: sum of q and entropy -sum q log q. Every TTT step scores the same teacher rows
    (shifted), so these are computed once instead of once per step."""
    rows = probs.shape[0]
    q_sum = torch.empty(rows, dtype=dtype, device=probs.device)
    entropy = torch.empty(rows, dtype=dtype, device=probs.device)
    for start in range(0, rows, chunk_rows):
        q = probs[start:start + chunk_rows].to(dtype)
        q_sum[start:start + chunk_rows] = q.sum(-1)
        entropy[start:start + chunk_rows] = -(q * torch.log(q.clamp(min=1e-30))).sum(-1)
    return q_sum, entropy


def _chunk_logits_pass(z, w_c, q, q_sum, w_rows, scale, target, acc_mask, acc: torch.dtype, cdtype: torch.dtype,
                       want_grads: bool):
    """One chunk: logits = z @ w_c.T [rows, vocab] -> [loss, correct, accept] sums and the gradient of the
    logits (in the compute dtype) for per-row gradient weights `scale`. Eager, each [rows, vocab] pass
    reads logits-sized memory, so they are kept few: the log-probs become p in place, then the gradient,
    and the teacher stays in its own dtype (mixed-dtype ops upcast on the fly). torch.compile fuses the
    softmax part into a few kernels that never hold fp32 [rows, vocab] (TTTModel(compile_head=True))."""
    logits = z @ w_c.T
    correct = ((logits.argmax(-1) == target) & acc_mask).sum().to(acc)
    logp = torch.log_softmax(logits, -1, dtype=acc)  # one fused kernel (logsumexp is four passes)
    del logits
    ce = -(logp * q).sum(-1)
    p = logp.exp_()
    accept = torch.minimum(p, q).sum(-1)
    sums = torch.stack([(ce * w_rows).sum(), correct, (accept * w_rows).sum()])
    if not want_grads:
        return sums, None
    return sums, p.mul_((q_sum * scale)[:, None]).addcmul_(q, scale[:, None], value=-1).to(cdtype)


# A machine without a working compiler (no Triton, no C compiler) trains eagerly with the same function:
# the compiled head must never stop a training run (its gain: bench/RESULTS.md, Drafter training).
_COMPILED_CHUNK_PASS = compiled_or_eager(_chunk_logits_pass, anywhere=True)


def _head_norm_forward(x, norm_w, eps: float, cdtype: torch.dtype, acc: torch.dtype):
    """Rows x of h -> (z = norm_w * y in the compute dtype, y = rmsnorm(x) in h's dtype, 1/rms in acc)."""
    x32 = x.to(acc)
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = (x32 * r).to(x.dtype)
    return (norm_w * y).to(cdtype), y, r


def _head_norm_backward(g_z, x, y, r, norm_w):
    """Gradient of z -> (gradient of the rows x in h's dtype, of norm_w in acc), autograd's roundings."""
    acc = r.dtype
    g_z = g_z.to(acc)
    g_norm = (g_z * y.to(acc)).sum(0)
    g_y = (g_z * norm_w).to(y.dtype).to(acc)  # autograd rounds the grad of y to y's dtype
    y_hat = x.to(acc) * r
    return (r * (g_y - y_hat * (g_y * y_hat).mean(-1, keepdim=True))).to(y.dtype), g_norm


# compile_head on CUDA: each one kernel (or two) instead of about 7 and 12 passes over [rows, hidden] fp32 per chunk
_COMPILED_HEAD_NORM = (compiled_or_eager(_head_norm_forward), compiled_or_eager(_head_norm_backward))



def _head_pass(steps: list[StepRows], norm_w, eps, head_w, cdtype, want_grads: bool,
               compiled: bool = False):
    """Loss total, stats [len(steps), fields] and (when want_grads) the gradients of norm_w, head_w and
    each step's h for a unit upstream gradient. Per row (the exact derivatives of the reference):
        y = rmsnorm(h);  z = norm_w * y;  logits = z @ W.T;  logp = log_softmax(logits);  p = exp(logp)
        loss = -w * sum_v q_v logp_v;   dloss/dlogits = w * (p * sum(q) - q)   (q need not sum to 1 in bf16)
    """
    acc = _acc_dtype(cdtype)
    chunk_pass = _COMPILED_CHUNK_PASS if compiled else _chunk_logits_pass
    norm_forward, norm_backward = _COMPILED_HEAD_NORM if compiled else (_head_norm_forward, _head_norm_backward)
    w_c = head_w.to(cdtype)
    g_head = torch.zeros_like(head_w) if want_grads else None
    g_norm = torch.zeros_like(norm_w) if want_grads else None
    g_hs = []
    total = torch.zeros((), dtype=acc, device=head_w.device)
    stats = []
    for step in steps:
        h = step.h
        positions = step.pos_mask.sum().to(acc)
        step_weight = (STEP_DECAY ** step.k) / positions.clamp(min=1)  # d total / d loss_sum of this step
        # Rows outside the accuracy mask add nothing anywhere: only step.chunks are read.
        every_row = sum(_chunk_len(c) for c in step.chunks) == h.shape[0]
        g_h = (torch.empty_like(h) if every_row else torch.zeros_like(h)) if want_grads else None
        sums = torch.zeros(4, dtype=acc, device=h.device)  # loss, correct, accept, entropy
        for chunk in step.chunks:
            if isinstance(chunk, slice):
                pick = (lambda t, rows=chunk: t[rows])
            else:
                pick = (lambda t, idx=chunk: t.index_select(0, idx))
            q, q_sum, w_rows = pick(step.probs), pick(step.q_sum), pick(step.pos_mask).to(acc)
            x = pick(h)
            z, y, r = norm_forward(x, norm_w, eps, cdtype, acc)
            chunk_sums, g_logits = chunk_pass(z, w_c, q, q_sum, w_rows, w_rows * step_weight, pick(step.target),
                                              pick(step.acc_mask), acc, cdtype, want_grads)
            sums += torch.cat([chunk_sums, (pick(step.entropy) * w_rows).sum()[None]])
            if not want_grads:
                continue
            assert g_head is not None and g_norm is not None and g_h is not None and g_logits is not None
            if g_head.dtype == cdtype:
                g_head.addmm_(g_logits.T, z)
            else:  # bf16 operands, fp32 accumulation across chunks and steps
                accumulate_fp32(g_head, g_logits.T, z)
            g_z = g_logits @ w_c
            del g_logits
            g_x, g_n = norm_backward(g_z, x, y, r, norm_w)
            g_norm += g_n.to(g_norm.dtype)
            if isinstance(chunk, slice):
                g_h[chunk] = g_x
            else:
                g_h.index_copy_(0, chunk, g_x)
        total = total + (STEP_DECAY ** step.k) * sums[0] / positions.clamp(min=1)
        stats.append(torch.stack([sums[0], positions, sums[1], step.acc_mask.sum().to(acc), sums[2], sums[3]]))
        g_hs.append(g_h)
    return total, torch.stack(stats), (g_norm, g_head, g_hs)


RowChunk = slice | torch.Tensor


def _chunk_len(chunk: RowChunk) -> int:
    return chunk.stop - chunk.start if isinstance(chunk, slice) else chunk.numel()


def row_chunks(teacher: TeacherOut, steps: int, device: torch.device, chunk_rows: int) -> list[tuple[RowChunk, ...]]:
    """For each TTT step k with rows to score, the rows of its accuracy mask (keep[:, k+1:] flattened) in
    chunks of at most chunk_rows: a slice where a chunk's rows run without a gap (a view: the usual case, a
    mask that drops a prompt and the record's end), else their indices on `device`. Picked on the host from
    teacher.keep_host (or one read of teacher.keep): a device-side nonzero per step would make the host
    wait for the GPU to drain 7 times a training step."""
    keep = teacher.keep_host if teacher.keep_host is not None else teacher.keep.cpu()
    plans: list[list[slice | int]] = []
    gathered: list[torch.Tensor] = []  # the chunks with gaps, copied to the device at once
    for k in range(min(steps, keep.shape[1] - 1)):
        rows = keep[:, k + 1:].reshape(-1).nonzero().squeeze(1)
        plan: list[slice | int] = []
        for start in range(0, rows.numel(), chunk_rows):
            idx = rows[start:start + chunk_rows]
            first, last = int(idx[0]), int(idx[-1])
            if last - first + 1 == idx.numel():
                plan.append(slice(first, last + 1))
            else:
                plan.append(len(gathered))
                gathered.append(idx)
        plans.append(plan)
    on_device: list[torch.Tensor] = []
    if gathered:
        flat = torch.cat(gathered)
        if device.type == "cuda":  # one copy for all steps, queued behind the work in flight
            flat = flat.pin_memory().to(device, non_blocking=True)
        else:
            flat = flat.to(device)
        on_device = list(flat.split([g.numel() for g in gathered]))
    return [tuple(c if isinstance(c, slice) else on_device[c] for c in plan) for plan in plans]


def _unflatten(ks: tuple[int, ...], chunks: tuple, tensors) -> list[StepRows]:
    n = len(ks)
    fields = [tensors[i * n:(i + 1) * n] for i in range(len(TENSOR_FIELDS))]
    return [StepRows._make((k, *(f[j] for f in fields), chunks[j])) for j, k in enumerate(ks)]


class _FusedHeadLoss(torch.autograd.Function):
    """Forward computes loss, stats and all gradients; backward scales the saved gradients by the
    upstream gradient (in place: it can run once, retain_graph is not supported)."""

    @staticmethod
    def forward(ctx, norm_w, head_w, eps, cdtype, compiled, ks, chunks, *tensors):
        steps = _unflatten(ks, chunks, tensors)
        with no_autocast(head_w.device.type):  # dtypes are chosen explicitly
            total, stats, grads = _head_pass(steps, norm_w, eps, head_w, cdtype, True, compiled)
        ctx.grads = grads
        ctx.n_inputs = 7 + len(tensors)
        ctx.mark_non_differentiable(stats)
        return total, stats

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total, grad_stats):
        if ctx.grads is None:
            raise RuntimeError("the fused head loss was back-propagated twice (retain_graph is not supported)")
        g_norm, g_head, g_hs = ctx.grads
        ctx.grads = None  # hand the buffers over: AccumulateGrad can adopt them without a copy
        scale = grad_total.to(g_head.dtype)
        for g in (g_norm, g_head, *g_hs):
            g.mul_(scale)
        grads = [g_norm, g_head, None, None, None, None, None, *g_hs]  # h is the first tensor field
        return tuple(grads + [None] * (ctx.n_inputs - len(grads)))


def fused_head_loss(steps: list[StepRows], norm_w, eps, head_w, cdtype, compiled: bool = False):
    """(total loss, stats [len(steps), fields]) over the given TTT steps; see _head_pass."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (norm_w, head_w, *(s.h for s in steps)))
    if needs_grad:
        ks = tuple(s.k for s in steps)
        tensors = [getattr(s, f) for f in TENSOR_FIELDS for s in steps]
        return _FusedHeadLoss.apply(norm_w, head_w, eps, cdtype, compiled, ks, tuple(s.chunks for s in steps), *tensors)
    with torch.no_grad(), no_autocast(head_w.device.type):
        total, stats, _ = _head_pass(steps, norm_w, eps, head_w, cdtype, False, compiled)
    return total, stats


# ---------------------------------------------------------------------------------------- model


class TTTModel(nn.Module):
    """Wraps the drafter so one forward() covers the whole unrolled step (what DDP needs)."""

    def __init__(self, drafter: Eagle3Drafter, ttt_steps: int, backend: str = DEFAULT_BACKEND, chunk_rows: int | None = None,
                 fused_loss: bool = True, compile_head: bool = False):
        super().__init__()
        self.drafter = drafter
        self.ttt_steps = ttt_steps
        self.backend = backend
        self.fused_loss = fused_loss
        self.compile_head = compile_head  # torch.compile the fused loss's softmax part (fused_loss only)
        self.chunk_rows = chunk_rows or (fused_chunk_rows(drafter.cfg.draft_vocab_size) if fused_loss
                                         else CHECKPOINT_CHUNK_ROWS)

    def forward(self, batch: Batch, teacher: TeacherOut):
        """Returns (weighted loss, stats [steps, len(STAT_FIELDS)] detached)."""
        with step_weights(self.drafter):  # each weight cast once, its gradient summed once (engine.train.mixed)
            return self._forward(batch, teacher)

    def _forward(self, batch: Batch, teacher: TeacherOut):
        d = self.drafter
        b, t = batch.input_ids.shape
        hidden = d.project(batch.aux.to(d.fc.weight.dtype) if not torch.is_autocast_enabled() else batch.aux)
        if self.fused_loss:  # teacher-only statistics, while few activations are held
            cdtype = head_compute_dtype(hidden.device, hidden.dtype, d.lm_head.weight.dtype)
            q_sum, entropy = teacher_row_stats(teacher.probs.reshape(b * t, -1), _acc_dtype(cdtype), self.chunk_rows)
            q_sum, entropy = q_sum.view(b, t), entropy.view(b, t)
            chunks = row_chunks(teacher, self.ttt_steps, hidden.device, self.chunk_rows)  # before the steps are queued
        cache: list = []
        scored = []  # (step, rows, probs, target, pos_mask, acc_mask) of the steps with positions to score
        for k in range(self.ttt_steps):
            hidden = d.step(shift_left(batch.input_ids, k + 1), hidden, k, cache, self.backend)
            n = t - k - 1  # draft positions with a teacher position s = t+k+1 inside the record
            if n <= 0:
                continue
            acc_mask = teacher.keep[:, k + 1:].reshape(b * n)
            target = teacher.target[:, k + 1:].reshape(b * n)
            scored.append((k, hidden[:, :n].reshape(b * n, -1), teacher.probs[:, k + 1:].reshape(b * n, -1),
                           target, acc_mask & (target >= 0), acc_mask))  # greedy token outside the vocab: no loss
        stats = torch.zeros(self.ttt_steps, len(STAT_FIELDS), device=hidden.device)
        if not scored:
            return hidden.new_zeros((), dtype=torch.float32), stats
        if self.fused_loss:
            steps = [StepRows(k, rows, probs, target, pos_mask, acc_mask, q_sum[:, k + 1:].reshape(-1),
                              entropy[:, k + 1:].reshape(-1), chunks[k])
                     for k, rows, probs, target, pos_mask, acc_mask in scored]
            total, got = fused_head_loss(steps, d.norm.weight, d.norm.eps, d.lm_head.weight, cdtype,
                                         self.compile_head)
        else:
            total, got = self._checkpointed(scored)
        stats = stats.to(got.dtype)
        stats[:len(scored)] = got  # the scored steps are 0..len-1 (a slice: a list index is a blocking copy on CUDA)
        return total, stats

    def _checkpointed(self, scored):
        """The reference path: autograd through _chunk_stats, recomputed in backward."""
        d = self.drafter
        total = torch.zeros((), dtype=torch.float32, device=scored[0][1].device)
        stats = []
        for k, rows, probs, target, pos_mask, acc_mask in scored:
            loss_sum = correct = accept = entropy = 0.0
            for start in range(0, rows.shape[0], self.chunk_rows):
                sl = slice(start, start + self.chunk_rows)
                args = (rows[sl], d.norm.weight, d.norm.eps, d.lm_head.weight, probs[sl], target[sl], pos_mask[sl],
                        acc_mask[sl])
                if rows.requires_grad:
                    # Recompute the [rows, draft_vocab] logits in backward instead of keeping 7 of them.
                    l_, c_, a_, e_ = checkpoint(_chunk_stats, *args, use_reentrant=False)
                else:
                    l_, c_, a_, e_ = _chunk_stats(*args)
                loss_sum, correct, accept, entropy = loss_sum + l_, correct + c_, accept + a_, entropy + e_
            positions = pos_mask.sum().to(l_.dtype)
            total = total + (STEP_DECAY ** k) * loss_sum / positions.clamp(min=1)
            stats.append(torch.stack([loss_sum.detach(), positions, correct, acc_mask.sum().to(l_.dtype), accept,
                                      entropy]))
        return total, torch.stack(stats)


def summarize(stats: torch.Tensor) -> dict:
    """Accumulated stats [steps, fields] -> per-step loss/KL/acc/accept and the simulated acceptance length."""
    s = stats.double().cpu()
    loss = (s[:, 0] / s[:, 1].clamp(min=1)).tolist()
    acc = (s[:, 2] / s[:, 3].clamp(min=1)).tolist()
    accept = (s[:, 4] / s[:, 1].clamp(min=1)).tolist()
    kl = ((s[:, 0] - s[:, 5]) / s[:, 1].clamp(min=1)).tolist()
    sim, run = 1.0, 1.0
    for a in acc:
        run *= a
        sim += run
    weighted = sum((STEP_DECAY ** k) * v for k, v in enumerate(loss))
    return {"loss": weighted, "loss_pos": loss, "kl_pos": kl, "acc": acc, "accept": accept, "sim_al": sim,
            "positions": int(s[0, 3])}
