"""The training-time-test forward: 7 unrolled steps, soft cross-entropy against the teacher,
per-step accuracy and expected acceptance. See engine.train.data for the alignment."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.train.data import Batch, TeacherOut
from engine.train.model import Eagle3Drafter, shift_left

STAT_FIELDS = ("loss_sum", "positions", "correct", "scored", "accept_sum", "entropy_sum")


def _chunk_stats(h, norm_w, eps, head_w, probs, target, pos_mask, acc_mask):
    """Loss sum over pos_mask, correct greedy guesses over acc_mask, sum of min(p, q) over pos_mask."""
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = (norm_w * x.to(h.dtype))
    logits = (x @ head_w.T).float()
    logp = torch.log_softmax(logits, -1)
    q = probs.float()
    w = pos_mask.float()
    loss = -((q * logp).sum(-1) * w).sum()
    with torch.no_grad():
        correct = ((logits.argmax(-1) == target) & acc_mask).sum().float()
        accept = (torch.minimum(logp.exp(), q).sum(-1) * w).sum()
        entropy = (-(q * torch.log(q.clamp(min=1e-30))).sum(-1) * w).sum()  # loss - entropy = KL(teacher||draft)
    return loss, correct, accept, entropy


class TTTModel(nn.Module):
    """Wraps the drafter so one forward() covers the whole unrolled step (what DDP needs)."""

    def __init__(self, drafter: Eagle3Drafter, ttt_steps: int, backend: str = "sdpa", chunk_rows: int = 4096):
        super().__init__()
        self.drafter = drafter
        self.ttt_steps = ttt_steps
        self.backend = backend
        self.chunk_rows = chunk_rows

    def forward(self, batch: Batch, teacher: TeacherOut):
        """Returns (weighted loss, stats [steps, len(STAT_FIELDS)] detached)."""
        d = self.drafter
        b, t = batch.input_ids.shape
        hidden = d.project(batch.aux.to(d.fc.weight.dtype) if not torch.is_autocast_enabled() else batch.aux)
        cache: list = []
        total = hidden.new_zeros((), dtype=torch.float32)
        stats = []
        for k in range(self.ttt_steps):
            hidden = d.step(shift_left(batch.input_ids, k + 1), hidden, k, cache, self.backend)
            n = t - k - 1  # draft positions with a teacher position s = t+k+1 inside the record
            if n <= 0:
                stats.append(torch.zeros(len(STAT_FIELDS), device=hidden.device))
                continue
            rows = hidden[:, :n].reshape(b * n, -1)
            probs = teacher.probs[:, k + 1:].reshape(b * n, -1)
            target = teacher.target[:, k + 1:].reshape(b * n)
            acc_mask = teacher.keep[:, k + 1:].reshape(b * n)
            pos_mask = acc_mask & (target >= 0)  # greedy target token outside the draft vocab: no loss
            loss_sum = total.new_zeros(())
            correct = total.new_zeros(())
            accept = total.new_zeros(())
            entropy = total.new_zeros(())
            for start in range(0, b * n, self.chunk_rows):
                sl = slice(start, start + self.chunk_rows)
                args = (rows[sl], d.norm.weight, d.norm.eps, d.lm_head.weight, probs[sl], target[sl], pos_mask[sl],
                        acc_mask[sl])
                if rows.requires_grad:
                    # Recompute the [rows, draft_vocab] logits in backward instead of keeping 7 of them.
                    l_, c_, a_, e_ = checkpoint(_chunk_stats, *args, use_reentrant=False)
                else:
                    l_, c_, a_, e_ = _chunk_stats(*args)
                loss_sum, correct, accept, entropy = loss_sum + l_, correct + c_, accept + a_, entropy + e_
            positions = pos_mask.sum().float()
            total = total + (0.8 ** k) * loss_sum / positions.clamp(min=1)
            stats.append(torch.stack([loss_sum.detach(), positions, correct, acc_mask.sum().float(), accept,
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
    weighted = sum((0.8 ** k) * v for k, v in enumerate(loss))
    return {"loss": weighted, "loss_pos": loss, "kl_pos": kl, "acc": acc, "accept": accept, "sim_al": sim,
            "positions": int(s[0, 3])}
