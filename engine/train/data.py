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
import queue
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from engine.model.weights_id import WEIGHTS_FIX, weights_id, weights_mismatch
from engine.records import RecordEntry, RecordError, load_record, read_manifest, read_run_meta
from engine.train.mixed import compiled_or_eager
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

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def to(self, device, dtype=None, non_blocking: bool = False) -> "Batch":
        """A copy on `device`. non_blocking only overlaps anything when the source is pinned."""
        def move(t: torch.Tensor, cast: bool) -> torch.Tensor:
            return t.to(device, dtype=dtype if cast else None, non_blocking=non_blocking or (cast and dtype is not None))

        return Batch(move(self.input_ids, False), move(self.loss_mask, False), move(self.aux, True),
                     move(self.hidden, True), move(self.lengths, False))

    def is_pinned(self) -> bool:
        return all(t.is_pinned() for t in self.tensors())

    def pin_memory(self) -> "Batch":
        return Batch(*(t.pin_memory() for t in self.tensors()))


def is_eval(sample_id: str, fraction: float) -> bool:
    """Whether the sample is held out for evaluation: a hash of its id, so the split never moves."""
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def target_weights(model_dir: Path) -> str | None:
    """The id of the target's weights (engine.model.weights_id) the data must come from."""
    try:
        return weights_id(model_dir)
    except OSError as exc:
        raise TrainDataError(f"the target's weights in {model_dir} cannot be read: {exc}") from None


class RecordData:
    """The records of one extraction run, split deterministically by sample id."""

    def __init__(self, run_dir: Path, hidden_size: int, max_len: int, eval_fraction: float,
                 model_dir: Path | None = None):
        """`model_dir`: the target trained against; records captured from other weights are refused."""
        self.run_dir = Path(run_dir)
        self.max_len = max_len
        self.meta = read_run_meta(self.run_dir)
        run_h = self.meta.get("hidden_size")
        if run_h is not None and int(run_h) != hidden_size:
            raise TrainDataError(f"{self.run_dir}: records have hidden size {run_h} but the target model has "
                                 f"{hidden_size}; point extract.run at records of this model or re-extract")
        if model_dir is not None:
            mismatch = weights_mismatch(self.meta, model_dir, target_weights(model_dir))
            if mismatch:  # the drafter would learn a model nobody serves
                raise TrainDataError(f"{self.run_dir}: {mismatch}. Fix: {WEIGHTS_FIX}")
        entries, problems = read_manifest(self.run_dir)
        usable = sorted((e for e in entries.values() if e.tokens >= 3), key=lambda e: e.index)
        if not usable:
            raise TrainDataError(f"{self.run_dir}/manifest.jsonl has no records of 3 or more tokens "
                                 f"({len(entries)} entries{'; ' + problems[0] if problems else ''}): "
                                 "run the extraction first (`eagle3-console run extract`)")
        self.hidden_size = hidden_size
        self.eval_entries = [e for e in usable if is_eval(e.id, eval_fraction)] if eval_fraction > 0 else []
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

    def collate(self, entries: list[RecordEntry], pin: bool = False) -> Batch:
        """Pad `entries` into one batch; pin=True builds it in page-locked memory (CUDA only), which a
        non-blocking copy to the GPU needs to overlap and which saves pinning it afterwards."""
        samples = [self.load(e) for e in entries]
        lengths = [min(int(s["input_ids"].shape[0]), self.max_len) for s in samples]
        t = max(lengths)
        b = len(samples)
        h = self.hidden_size
        ids = torch.zeros(b, t, dtype=torch.int64, pin_memory=pin)
        mask = torch.zeros(b, t, dtype=torch.bool, pin_memory=pin)
        aux = torch.zeros(b, t, 3 * h, dtype=samples[0]["aux_hidden_state"].dtype, pin_memory=pin)
        hid = torch.zeros(b, t, h, dtype=samples[0]["hidden_state"].dtype, pin_memory=pin)
        for i, (s, n) in enumerate(zip(samples, lengths)):
            ids[i, :n] = s["input_ids"][:n]
            mask[i, :n] = s["loss_mask"][:n].bool()
            aux[i, :n] = s["aux_hidden_state"][:n]
            hid[i, :n] = s["hidden_state"][:n]
        lens = torch.tensor(lengths, dtype=torch.int64)
        return Batch(ids, mask, aux, hid, lens.pin_memory() if pin else lens)

    def epoch_order(self, seed: int, epoch: int) -> list[RecordEntry]:
        """Shuffled train order, a pure function of (seed, epoch): resume replays it exactly."""
        order = list(self.train_entries)
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return order

    def batches_per_epoch(self, batch_size: int, world: int = 1) -> int:
        per_step = batch_size * world
        return max(1, len(self.train_entries) // per_step)


class _Failed:
    """What the loader thread hands over instead of a batch when loading raised."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class BatchPrefetcher:
    """The batches of steps `steps`, in order, ready on `device` before they are asked for.

    A thread calls `load(step)` (reading, hashing and padding records) up to `depth` steps ahead. On
    CUDA the batch is in page-locked memory (pinned here unless `load` built it so) and its copy to the
    GPU is a non-blocking one on a side stream: issued when the step asks for its batch (ahead=0), it
    runs under the previous step's optimizer kernels still in flight, with no more GPU memory than a
    pageable copy; ahead=1 issues it one step earlier, under the whole previous step, for one more
    batch held on the GPU through that step's peak. The consumer's stream waits for that copy's event
    only (not for a later batch's copy queued behind it), and each tensor is marked as used by the
    consumer's stream so the allocator does not hand its memory to the side stream while a step still
    reads it. On the CPU this is the plain path on a thread: `load(step)` as is.

    A loader exception reaches the consumer, with its message, at the step that needed the batch.
    `close()` (or leaving the `with` block) stops and joins the thread, whatever it was doing."""

    def __init__(self, load: Callable[[int], Batch], steps: range, device: torch.device | str, depth: int = 2,
                 ahead: int = 0, interrupt: Callable[[], None] | None = None):
        self.load = load
        self.interrupt = interrupt  # makes a `load` that waits (for online captures) give up, on close()
        self.ahead = ahead
        self.steps = steps
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda"
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(self.device) if self.gpu else None
        # (batch on the device, copy-done event) for the next step, already on its way
        self._staged: tuple[Batch, torch.cuda.Event | None] | _Failed | None = None
        self._handed = 0
        self._thread = threading.Thread(target=self._produce, name="train-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        for step in self.steps:
            try:
                batch = self.load(step)
                if self.gpu and not batch.is_pinned():
                    batch = batch.pin_memory()
                item: Batch | _Failed = batch
            except BaseException as exc:  # handed to the consumer, raised there
                item = _Failed(exc)
            while not self._stop.is_set():
                try:
                    self._ready.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item, _Failed):
                return

    def _take(self) -> Batch | _Failed:
        while True:
            try:
                return self._ready.get(timeout=0.05)
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    return _Failed(RuntimeError("the batch loader thread ended before the last step"))

    def wait(self, timeout: float) -> bool:
        """True once the next batch (or its failure) is at hand, so that `next()` will not block; False
        after `timeout` s without it (the caller may do something else meanwhile: see a stop request)."""
        if self._staged is not None or self._handed >= len(self.steps):
            return True
        try:
            item: Batch | _Failed = self._ready.get(timeout=timeout)
        except queue.Empty:
            if self._thread.is_alive() or not self._ready.empty():
                return False
            item = _Failed(RuntimeError("the batch loader thread ended before the last step"))
        self._stage(item)
        return True

    def _stage(self, item: Batch | _Failed | None = None) -> None:
        batch = self._take() if item is None else item
        if isinstance(batch, _Failed) or self._stream is None:
            self._staged = batch if isinstance(batch, _Failed) else (batch.to(self.device), None)
            return
        with torch.cuda.stream(self._stream):
            on_device = batch.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._staged = (on_device, done)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._handed >= len(self.steps):
            raise StopIteration
        if self._staged is None:
            self._stage()
        staged = self._staged
        self._staged = None
        if isinstance(staged, _Failed):
            raise staged.exc  # at the step whose batch failed, not the one before it
        assert staged is not None
        batch, done = staged
        self._handed += 1
        if self.ahead and self.gpu and self._handed < len(self.steps):
            self._stage()  # the next copy is queued now and runs under this step's kernels
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for t in batch.tensors():
                t.record_stream(current)
        return batch

    def close(self) -> None:
        self._stop.set()
        if self.interrupt is not None:
            self.interrupt()
        while True:  # unblock a put waiting on a full queue
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        self._thread.join()
        self._staged = None

    def __enter__(self) -> "BatchPrefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class TeacherOut:
    probs: torch.Tensor  # [B, T, Vd] teacher distribution over the draft vocabulary, per teacher position s
    target: torch.Tensor  # int64 [B, T]: draft id of the target's greedy token, -1 if outside the vocab
    keep: torch.Tensor  # bool [B, T]: predicted token s+1 exists and is loss-masked
    keep_host: torch.Tensor | None = None  # `keep` on the host: which rows the loss scores, known without a device read


def keep_mask(batch: Batch) -> torch.Tensor:
    """bool [B, T]: teacher position s scores the draft's guess of token s+1 (inside the record, loss-masked)."""
    t = batch.loss_mask.shape[1]
    positions = torch.arange(t, device=batch.loss_mask.device)[None, :]
    next_mask = torch.zeros_like(batch.loss_mask)
    next_mask[:, :-1] = batch.loss_mask[:, 1:]
    return next_mask & (positions + 1 < batch.lengths[:, None])


def _draft_softmax(logits: torch.Tensor, hot_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the draft vocabulary's columns of full-vocabulary logits, in fp32, stored as `dtype`."""
    return torch.softmax(logits[:, hot_ids].float(), -1).to(dtype)


# Compiled on CUDA, the column gather, the widening, the softmax and the narrowing are one pass over the
# draft columns instead of five over logits-sized tensors.
_draft_softmax_kernel = compiled_or_eager(_draft_softmax)


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
        keep = keep_mask(batch)
        # The step's one read of the device, made before the head's kernels are queued: it waits for the
        # batch's copy only, and the loss then picks its rows with no further wait (engine.train.loss).
        keep_host = keep.cpu()
        flat = batch.hidden.reshape(b * t, h).to(self.weight.dtype)
        chunks: list[torch.Tensor] = []
        greedy: list[torch.Tensor] = []
        for start in range(0, max(b * t, 1), self.chunk_rows):  # full-vocab logits only a chunk at a time
            # In the head's dtype: widening is exact, so the argmax and the draft columns' softmax are
            # the same as over fp32 logits, without a full-vocabulary fp32 copy (2 GB at 4,096 tokens).
            logits = flat[start:start + self.chunk_rows] @ self.weight.T
            greedy.append(logits.argmax(-1))
            chunks.append(_draft_softmax_kernel(logits, self.hot_ids, probs_dtype))
        probs = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        target = self.to_draft[greedy[0] if len(greedy) == 1 else torch.cat(greedy)]
        return TeacherOut(probs.view(b, t, self.hot_ids.shape[0]), target.view(b, t), keep, keep_host)
