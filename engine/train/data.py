"""Training data: extraction records -> padded batches, the train/eval split, and the teacher.

Alignment (documented because off-by-one errors here are silent). For a record of length T,
`hidden_state[s]` is the target's state after token s, so `lm_head(hidden_state[s])` is the
target's distribution of token s+1. At TTT step k (k = 0..ttt_steps-1) the drafter at position t
reads token `input_ids[t+k+1]` and (step 0) the target features `aux_hidden_state[t]`, sits at
RoPE position t+k, and is trained toward the teacher at s = t+k+1, i.e. the distribution of token
t+k+2. This is SpecForge's convention (inputs and teacher shifted left by one, then by one more per
step). The loss is kept where the *predicted* token s+1 is a loss-masked (assistant) token and
exists in the record; SpecForge masks with the input token's flag instead, one position earlier,
which trains one extra position at the start of each reply and one past its end.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.records import RecordEntry, RecordError, load_record, read_manifest, read_run_meta
from engine.errors import EngineError


class TrainDataError(EngineError, ValueError):
    """The training inputs are unusable; the message names the problem and the fix."""


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, T]
    loss_mask: torch.Tensor  # bool [B, T]
    aux: torch.Tensor  # [B, T, 3Ht]
    hidden: torch.Tensor  # [B, T, Ht]
    lengths: torch.Tensor  # int64 [B]

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device, dtype=None) -> "Batch":
        cast = (lambda t: t.to(device, dtype=dtype, non_blocking=True)) if dtype else (lambda t: t.to(device))
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), cast(self.aux), cast(self.hidden),
                     self.lengths.to(device))


def _is_eval(sample_id: str, fraction: float) -> bool:
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


class RecordData:
    """The records of one extraction run, split deterministically by sample id."""

    def __init__(self, run_dir: Path, hidden_size: int, max_len: int, eval_fraction: float):
        self.run_dir = Path(run_dir)
        self.max_len = max_len
        self.meta = read_run_meta(self.run_dir)
        run_h = self.meta.get("hidden_size")
        if run_h is not None and int(run_h) != hidden_size:
            raise TrainDataError(f"{self.run_dir}: records have hidden size {run_h} but the target model has "
                                 f"{hidden_size}; point extract.run at records of this model or re-extract")
        entries, problems = read_manifest(self.run_dir)
        usable = sorted((e for e in entries.values() if e.tokens >= 3), key=lambda e: e.index)
        if not usable:
            raise TrainDataError(f"{self.run_dir}/manifest.jsonl has no records of 3 or more tokens "
                                 f"({len(entries)} entries{'; ' + problems[0] if problems else ''}): "
                                 "run the extraction first (`eagle3-console run extract`)")
        self.hidden_size = hidden_size
        self.eval_entries = [e for e in usable if _is_eval(e.id, eval_fraction)] if eval_fraction > 0 else []
        if eval_fraction > 0 and not self.eval_entries and len(usable) >= 2:
            self.eval_entries = [usable[-1]]
        if len(self.eval_entries) == len(usable):
            self.eval_entries = self.eval_entries[1:]
        eval_ids = {e.id for e in self.eval_entries}
        self.train_entries = [e for e in usable if e.id not in eval_ids]
        self._verified: set[str] = set()
        self.check_shapes(self.train_entries[0])

    def check_shapes(self, entry: RecordEntry) -> None:
        tensors = self.load(entry)
        h = tensors["hidden_state"].shape[-1]
        if h != self.hidden_size or tensors["aux_hidden_state"].shape[-1] != 3 * self.hidden_size:
            raise TrainDataError(f"{entry.path}: hidden_state width {h}, aux width "
                                 f"{tensors['aux_hidden_state'].shape[-1]}; the target model has hidden size "
                                 f"{self.hidden_size}: these records belong to another model — re-extract")

    def load(self, entry: RecordEntry) -> dict:
        verify = entry.id not in self._verified  # hash each record once per process
        try:
            tensors = load_record(self.run_dir, entry, verify=verify)
        except FileNotFoundError:
            raise TrainDataError(f"{self.run_dir / entry.path} is missing: resume the extraction to redo it") from None
        except RecordError as exc:
            raise TrainDataError(str(exc)) from None
        self._verified.add(entry.id)
        return tensors

    def collate(self, entries: list[RecordEntry]) -> Batch:
        samples = [self.load(e) for e in entries]
        lengths = [min(int(s["input_ids"].shape[0]), self.max_len) for s in samples]
        t = max(lengths)
        b = len(samples)
        h = self.hidden_size
        ids = torch.zeros(b, t, dtype=torch.int64)
        mask = torch.zeros(b, t, dtype=torch.bool)
        aux = torch.zeros(b, t, 3 * h, dtype=samples[0]["aux_hidden_state"].dtype)
        hid = torch.zeros(b, t, h, dtype=samples[0]["hidden_state"].dtype)
        for i, (s, n) in enumerate(zip(samples, lengths)):
            ids[i, :n] = s["input_ids"][:n]
            mask[i, :n] = s["loss_mask"][:n].bool()
            aux[i, :n] = s["aux_hidden_state"][:n]
            hid[i, :n] = s["hidden_state"][:n]
        return Batch(ids, mask, aux, hid, torch.tensor(lengths, dtype=torch.int64))

    def epoch_order(self, seed: int, epoch: int) -> list[RecordEntry]:
        """Shuffled train order, a pure function of (seed, epoch): resume replays it exactly."""
        order = list(self.train_entries)
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return order

    def batches_per_epoch(self, batch_size: int, world: int = 1) -> int:
        per_step = batch_size * world
        return max(1, len(self.train_entries) // per_step)


@dataclass
class TeacherOut:
    probs: torch.Tensor  # [B, T, Vd] teacher distribution over the draft vocabulary, per teacher position s
    target: torch.Tensor  # int64 [B, T]: draft id of the target's greedy token, -1 if outside the vocab
    keep: torch.Tensor  # bool [B, T]: predicted token s+1 exists and is loss-masked


class Teacher:
    """The target's LM head on the captured final state, renormalised over the draft vocabulary."""

    def __init__(self, lm_head: torch.Tensor, hot_ids: torch.Tensor, chunk_rows: int = 4096):
        self.weight = lm_head
        self.hot_ids = hot_ids.to(lm_head.device)
        vocab = lm_head.shape[0]
        table = torch.full((vocab,), -1, dtype=torch.int64, device=lm_head.device)
        table[self.hot_ids] = torch.arange(self.hot_ids.shape[0], device=lm_head.device)
        self.to_draft = table
        self.chunk_rows = chunk_rows

    @torch.no_grad()
    def __call__(self, batch: Batch, probs_dtype=torch.float32) -> TeacherOut:
        b, t, h = batch.hidden.shape
        flat = batch.hidden.reshape(b * t, h).to(self.weight.dtype)
        probs = torch.empty(b * t, self.hot_ids.shape[0], dtype=probs_dtype, device=flat.device)
        greedy = torch.empty(b * t, dtype=torch.int64, device=flat.device)
        for start in range(0, b * t, self.chunk_rows):  # full-vocab logits only a chunk at a time
            logits = (flat[start:start + self.chunk_rows] @ self.weight.T).float()
            greedy[start:start + self.chunk_rows] = logits.argmax(-1)
            probs[start:start + self.chunk_rows] = torch.softmax(logits[:, self.hot_ids], -1).to(probs_dtype)
        positions = torch.arange(t, device=flat.device)[None, :]
        next_mask = torch.zeros_like(batch.loss_mask)
        next_mask[:, :-1] = batch.loss_mask[:, 1:]
        keep = next_mask & (positions + 1 < batch.lengths[:, None])
        return TeacherOut(probs.view(b, t, -1), self.to_draft[greedy].view(b, t), keep)
