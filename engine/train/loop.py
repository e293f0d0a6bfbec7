"""The training loop: AdamW, warmup + cosine, clipping, bf16 autocast on GPU, metrics, checkpoints,
exact resume, DDP under torchrun (rank 0 writes), SIGTERM -> checkpoint -> exit.

Non-finite training is a failure the operator sees: a step whose loss or gradient norm is NaN/inf is
not applied (its gradients are dropped), no checkpoint is taken while such steps run or while the
weights are not finite, and after NONFINITE_LIMIT of them in a row (or when the run ends on one) the
run stops with a TrainError naming the step, the values and the fix: a `nonfinite` event, a
`{"type": "failed", "reason": "nonfinite", ...}` line in metrics.jsonl (which `check train` shows in
red; a resume trims it with the other lines past its checkpoint), exit status 2 from the job.
metrics.jsonl and the events stay strict JSON: a non-finite number is written as "NaN"/"Infinity".
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

from engine.io import atomic
from engine.io.jsonl import dumps_line
from engine.system.procinfo import die_with_parent
from engine.model.target import TargetError, plan_target, sglang_layer_ids
from engine.train import checkpoint as ckpt
from engine.train.attention import DEFAULT_BACKEND, check_backend
from engine.train.data import BatchPrefetcher, RecordData, Teacher, TrainDataError
from engine.train.loss import STAT_FIELDS, TTTModel, summarize
from engine.train.model import DraftConfig, Eagle3Drafter
from engine.train.vocab import build_vocab, draft_vocab_size, validate_vocab
from engine.errors import EngineError

METRICS = "metrics.jsonl"
VOCAB = "vocab.safetensors"
# Consecutive steps with a non-finite loss or gradient norm after which the run stops (failed). A
# single one is skipped (an fp overflow on one odd batch can recover); three in a row do not recover
# in practice: the weights themselves are no longer finite (a learning rate far too high, say).
NONFINITE_LIMIT = 3


class TrainError(EngineError):
    """Training cannot start or continue; the message names the problem and the fix."""


def load_target_embedding(model_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    from engine.model.lmhead import EMBED_NAMES, LmHeadError, tensor_files

    files = tensor_files(Path(model_dir))
    for name in EMBED_NAMES:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as handle:
                return handle.get_tensor(name)
    raise LmHeadError(f"{model_dir}: no embedding tensor (looked for {', '.join(EMBED_NAMES)})")


def build_adamw(params, lr: float, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW (no weight decay). Fused on CUDA by default: one kernel per step instead of foreach's chains,
    which also allocate parameter-sized fp32 temporaries at the step's peak."""
    params = list(params)
    if fused is None:
        fused = bool(params) and all(p.is_cuda for p in params)
    if fused:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def clip_gradients(optim: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The gradients' total norm before clipping, and the gradients scaled to a norm of at most max_norm
    (clip_grad_norm_'s rule). A fused AdamW gets the scale as its grad_scale, which its kernel divides each
    gradient by as it reads it, instead of a pass of its own over every gradient; the caller clears
    optim.grad_scale after the step (or the skipped step)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if optim.defaults.get("fused") and grads:
        optim.grad_scale = (1.0 / coef).float()  # type: ignore[attr-defined]
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def place_drafter(model: Eagle3Drafter, device: torch.device | str) -> Eagle3Drafter:
    """Move the drafter to `device`. On CUDA the frozen target embedding is held in bf16 (half of 2 GB at a
    128k vocabulary): it only feeds a lookup whose result is cast to the bf16 compute dtype, and the
    target ships it in bf16. Trainable weights stay fp32 (the optimizer's master copy)."""
    device = torch.device(device)
    if device.type == "cuda":
        model.embed_tokens.to(torch.bfloat16)  # before the move: the fp32 copy never reaches the GPU
    return model.to(device)


def compile_head_wanted(gpu: bool) -> bool:
    """torch.compile the fused loss's softmax part: on by default on CUDA, where it trains faster
    than without (bench/RESULTS.md, Drafter training);
    EAGLE3_TRAIN_COMPILE_HEAD=0 or 1 forces it. Off on CPU, where compiling costs more than it saves."""
    value = os.environ.get("EAGLE3_TRAIN_COMPILE_HEAD", "").strip()
    return value == "1" if value in ("0", "1") else gpu


def lr_factor(step: int, total: int, warmup: int) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    def __init__(self, workspace, ctx=None, resume: bool = False, max_steps: int | None = None,
                 device: str | None = None, backend: str | None = None):
        self.ws = workspace
        self.cfg = workspace.config.train
        self.ctx = ctx
        self.resume = resume
        self.max_steps = max_steps
        self.stop_requested = False
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if device is None:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        # flex_attention recompiles for every new sequence length; real datasets have many lengths, so a
        # fused kernel that needs no compilation (cudnn, then flash) is the default. EAGLE3_TRAIN_ATTENTION picks another.
        try:
            self.backend = check_backend(backend or os.environ.get("EAGLE3_TRAIN_ATTENTION", DEFAULT_BACKEND))
        except ValueError as exc:
            raise TrainError(str(exc)) from None
        self.out_dir: Path = workspace.drafter_dir
        self.nonfinite_streak = 0  # steps in a row with a non-finite loss or gradient norm
        self.step_finite, self.step_loss, self.step_lr = True, math.nan, math.nan

    # ------------------------------------------------------------------ reporting
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def event(self, kind: str, **data) -> None:
        if not self.is_main:
            return
        if self.ctx is not None:
            self.ctx.event(kind, **data)
        else:
            print(dumps_line({"type": kind, **data}, default=str), flush=True)

    def metric(self, record: dict) -> None:
        if self.is_main:
            atomic.append_line(self.out_dir / METRICS, dumps_line(record))

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from engine.model.lmhead import LmHeadError, load_lm_head
        from engine.records import RecordError

        if self.world > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
            die_with_parent()  # each rank has a session of its own: without this it outlives a killed torchrun
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._check_numbers()
        model_dir = self.ws.model_dir
        try:
            target = plan_target(model_dir)
        except TargetError as exc:
            raise TrainError(f"cannot plan the target in {model_dir}: {exc}") from None
        text = target.text
        hidden = target.hidden_size
        run_dir = self.ws.hidden_dir
        try:
            if self.online:
                self.data = self._online_data()
            else:
                self.data = RecordData(run_dir, hidden, self.cfg.max_len, self.cfg.eval_fraction, model_dir)
        except RecordError as exc:
            raise TrainError(f"{exc}; run the extraction first") from None
        except TrainDataError as exc:
            raise TrainError(str(exc)) from None
        layers = [int(x) for x in self.data.meta.get("layers") or []]
        if len(layers) != 3:
            raise TrainError(f"{run_dir}/run.json lists no capture layers; re-run the extraction")
        try:  # the ids SGLang turns back into exactly these layers, by the target architecture's rule
            layer_ids = sglang_layer_ids(target.architecture, layers)
        except ValueError as exc:
            raise TrainError(f"the records hold layers {layers}: {exc}") from None
        vocab_size = draft_vocab_size(self.cfg.draft_vocab_size, target.vocab_size)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        vocab = self._vocab(run_dir, vocab_size)
        try:
            head = load_lm_head(model_dir)
            embed = load_target_embedding(model_dir)
        except (LmHeadError, OSError) as exc:
            raise TrainError(f"target LM head/embedding unavailable: {exc}") from None
        if head.shape[1] != hidden or embed.shape[1] != hidden:
            raise TrainError(f"LM head {list(head.shape)} / embedding {list(embed.shape)} do not match hidden {hidden}")
        dcfg = DraftConfig.from_target(text, vocab_size, layer_ids)
        torch.manual_seed(self.cfg.seed)
        self.model = Eagle3Drafter(dcfg)
        with torch.no_grad():
            self.model.embed_tokens.weight.copy_(embed.float())
            self.model.set_vocab(vocab.d2t, vocab.t2d)
        place_drafter(self.model, self.device)
        self.gpu = self.device.type == "cuda"
        self.teacher = Teacher(head.to(self.device, torch.bfloat16 if self.gpu else torch.float32),
                               vocab.hot_ids)
        self.ttt = TTTModel(self.model, self.cfg.ttt_steps, self.backend, compile_head=compile_head_wanted(self.gpu))
        self.ddp: torch.nn.Module = self.ttt
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(self.ttt, device_ids=[self.device.index] if self.gpu else None,
                                               broadcast_buffers=False)
        self.optim = build_adamw(self.model.trainable_parameters(), self.cfg.learning_rate)
        self.steps_per_epoch = self.data.batches_per_epoch(self.cfg.batch_size, self.world)
        self.total_steps = self.steps_per_epoch * self.cfg.epochs
        warmup = int(self.cfg.warmup_ratio * self.total_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.optim, lambda s: lr_factor(s, self.total_steps, warmup))
        self.step = 0
        self.best_sim_al = -1.0
        self.best_step: int | None = None
        if self.resume:
            self._load_checkpoint()
        elif ckpt.latest(self.out_dir):
            raise TrainError(f"{self.out_dir} already holds checkpoints: resume with --resume, or set train.run "
                             "to a new name (the old drafter is kept)")
        if self.is_main:
            # Lines past the starting step come from a run that died before checkpointing them
            # (even before its first checkpoint): they are redone, so drop them (no duplicates).
            self._trim_metrics()

    @property
    def online(self) -> bool:
        """train.mode online or hybrid: states captured from the server while training (engine.train.online)."""
        return self.cfg.mode in ("online", "hybrid")

    def _online_data(self):
        from engine.model.target import TargetError, workspace_plan
        from engine.train.online import OnlineData

        try:
            target = workspace_plan(self.ws)  # the layers the server captures: console.toml's
        except TargetError as exc:
            raise TrainError(f"cannot plan the target: {exc}") from None
        # Each rank captures its own batches into its own share of the window; only rank 0 reports (and
        # restarts a crashed server).
        return OnlineData(self.ws, target, self.cfg.max_len, self.cfg.eval_fraction, self.cfg.batch_size,
                          ctx=self.ctx if self.is_main else None, rank=self.rank, world=self.world)

    def _data_position(self) -> dict:
        """Where the data stands at this step: the next step trains sample `next_index` of epoch `epoch`'s
        order onwards (a pure function of the step; stored in checkpoints and shown on resume)."""
        epoch, index = divmod(self.step, self.steps_per_epoch)
        return {"mode": self.cfg.mode, "epoch": epoch, "next_index": index * self.cfg.batch_size * self.world}

    def _check_data_mode(self, data: dict | None) -> None:
        """Offline and online runs split and order different sample sets (the extraction's records vs the
        dataset's plan), so a checkpoint resumes only under the family it was trained in; online and hybrid
        share one. A checkpoint from before train.mode existed was trained offline."""
        was = (data or {}).get("mode", "offline")
        if (was == "offline") != (self.cfg.mode == "offline"):
            raise TrainError(f"the checkpoints in {self.out_dir} were trained with train.mode = {was!r}, console.toml "
                             f"says {self.cfg.mode!r}: set train.mode back to {was!r} to resume them, or set train.run "
                             "to a new name to start another drafter (this one is kept)")

    def _start_stream(self, limit: int) -> None:
        """Online: start capturing the batches of the steps ahead (the ones `_batch_entries` names);
        offline: note the records trained from."""
        if self.online and self.step < limit:
            self.data.start(self._batch_entries, self.step, limit)
        elif not self.online and self.is_main:  # which mode trained this drafter (check train says)
            atomic.write_json(self.out_dir / "data.json", {"mode": "offline", "records": str(self.ws.hidden_dir),
                                                           "t": time.time()})

    def _data_progress(self) -> dict:
        return self.data.progress_fields(self.step, self.steps_per_epoch) if self.online else {}

    def _sum_window_figures(self) -> None:
        """Online on several ranks: every rank's window figures summed into the data's `totals`, which its
        progress and end figures report (on rank 0). Collective: every rank calls it at the same step."""
        if not self.online or self.world == 1:
            return
        figures = torch.tensor(self.data.figures(), dtype=torch.float64, device=self.device)
        self.data.totals = dict(zip(self.data.FIGURES, self._all_reduce(figures).tolist()))

    def _check_numbers(self) -> None:
        """The trainer's own guard (whatever the config validation lets through): a learning rate that is
        not a finite number above 0, or a NaN/negative clip, would train every step on NaN."""
        lr, clip = self.cfg.learning_rate, self.cfg.grad_clip
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise TrainError(f"train.learning_rate = {lr} is not a finite number above 0: set it in console.toml "
                             "(1e-4 is a usual start)")
        if clip is not None and not (isinstance(clip, (int, float)) and clip >= 0):
            raise TrainError(f"train.grad_clip = {clip} is not a number >= 0: set it in console.toml "
                             "(1.0 is usual; 0 turns clipping off)")

    def _vocab(self, run_dir: Path, size: int):
        """The draft vocabulary, fixed at the first start: regenerating it on resume would misalign lm_head rows."""
        from safetensors.torch import load, save

        from engine.records import RecordError, load_token_counts

        path = self.out_dir / VOCAB
        if path.is_file():
            tensors = load(path.read_bytes())
            validate_vocab(tensors["d2t"], tensors["t2d"])
            if tensors["d2t"].shape[0] != size:
                raise TrainError(f"{path} has {tensors['d2t'].shape[0]} draft tokens, config asks for {size}: "
                                 "set train.run to a new name to change the draft vocabulary")
            from engine.train.vocab import DraftVocab

            return DraftVocab(tensors["d2t"], tensors["t2d"], float(tensors["coverage"]))
        try:
            counts = self.data.token_counts() if self.online else load_token_counts(run_dir)
        except RecordError as exc:
            raise TrainError(str(exc)) from None
        vocab = build_vocab(counts, size)
        validate_vocab(vocab.d2t, vocab.t2d)
        if self.is_main:
            atomic.write_bytes(path, save({"d2t": vocab.d2t, "t2d": vocab.t2d,
                                           "coverage": torch.tensor(vocab.coverage, dtype=torch.float64)}))
        return vocab

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        trainable = {k: v for k, v in self.model.state_dict().items() if k != "embed_tokens.weight"}
        return {
            "step": self.step, "model": trainable, "optim": self.optim.state_dict(),
            "sched": self.sched.state_dict(), "best_sim_al": self.best_sim_al,
            "best_step": self.best_step,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if self.gpu else None},
            "config": self.model.cfg.to_dict(), "total_steps": self.total_steps, "data": self._data_position(),
        }

    def save_checkpoint(self) -> Path | None:
        if not self.is_main:
            return None
        try:
            path = ckpt.save(self.out_dir, self.step, self._state())
        except ckpt.CheckpointError as exc:  # the loop saves only finite weights: a bug if it happens
            raise TrainError(f"{exc}; report a bug") from None
        self.event("checkpoint", step=self.step, path=str(path))
        return path

    def _verified_checkpoint(self) -> dict | None:
        """The state to resume from: latest.json's checkpoint when it verifies (sha256 beside it, finite
        weights), else the newest one that does, each refusal an event naming the file and why. None when
        there is no checkpoint at all (a fresh start); TrainError when there are only damaged ones: a
        start over is the user's call, never taken silently."""
        named = (ckpt.latest(self.out_dir) or {}).get("path")
        order = ([named] if named else []) + [name for name in ckpt.candidates(self.out_dir) if name != named]
        if not order:
            return None  # --resume on a fresh run simply starts
        rejected = []
        for name in order:
            try:
                state, signed = ckpt.load_checked(self.out_dir, name)
            except ckpt.CheckpointError as exc:
                rejected.append(str(exc))
                self.event("checkpoint_rejected", path=name, message=f"not resumed from {name}: {exc}")
                continue
            if not signed:
                self.event("checkpoint_unverified", path=name,
                           message=f"{name} has no {ckpt.MANIFEST} (saved by an older version): resumed from it "
                                   "on finite weights alone")
            if rejected:
                self.event("checkpoint_fallback", path=name, step=int(state["step"]),
                           message=f"resuming from {name}, the newest intact checkpoint; "
                                   f"{len(rejected)} newer one(s) refused")
            return state
        root = ckpt.ckpt_root(self.out_dir)
        raise TrainError(f"no intact checkpoint to resume from in {root} (nothing was trained): "
                         f"{'; '.join(rejected[:3])}{f'; and {len(rejected) - 3} more' if len(rejected) > 3 else ''}. "
                         f"To start over, set train.run to a new name (this drafter directory is kept) or move "
                         f"{root} aside, then `eagle3-console run train`")

    def _load_checkpoint(self) -> None:
        state = self._verified_checkpoint()
        if state is None:
            return
        if state["config"] != self.model.cfg.to_dict():
            raise TrainError(f"checkpoint in {self.out_dir} was made for another drafter shape; "
                             "set train.run to a new name")
        self._check_data_mode(state.get("data"))
        self.model.load_state_dict(state["model"], strict=False)
        self.optim.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.step = int(state["step"])
        self._apply_config_learning_rate()
        self.best_sim_al = float(state["best_sim_al"])
        self.best_step = state.get("best_step")
        if self.is_main and self.best_step is not None and (ckpt.best(self.out_dir) or {}).get("step") != self.best_step:
            ckpt.mark_best(self.out_dir, self.best_step, self.best_sim_al)  # killed before best.json was written
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if self.gpu and state["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.event("resumed", step=self.step, **self._data_position())

    def _apply_config_learning_rate(self) -> None:
        """The checkpoint restores the learning rate it was taken with; train.learning_rate wins (lowering it
        and resuming is the fix a blown-up run names). Unchanged, the resume stays exact."""
        lr = float(self.cfg.learning_rate)
        if all(base == lr for base in self.sched.base_lrs):
            return
        old = self.sched.base_lrs[0]
        self.sched.base_lrs = [lr] * len(self.sched.base_lrs)
        for group, lmbda in zip(self.optim.param_groups, self.sched.lr_lambdas):
            group["initial_lr"] = lr
            group["lr"] = lr * lmbda(self.sched.last_epoch)
        self.sched._last_lr = [group["lr"] for group in self.optim.param_groups]
        self.event("learning_rate_changed", step=self.step, old=old, new=lr)

    def _trim_metrics(self) -> None:
        """Metric lines after the checkpoint are redone by the resumed run: drop them (no duplicates)."""
        path = self.out_dir / METRICS
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            return
        kept = []
        for line in lines:
            try:
                if int(json.loads(line).get("step", 0)) <= self.step:
                    kept.append(line)
            except (ValueError, AttributeError):
                continue  # a torn line from a crash
        atomic.write_text(path, "".join(line + "\n" for line in kept))

    # ------------------------------------------------------------------ steps
    def _batch_entries(self, step: int) -> list:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = self.data.epoch_order(self.cfg.seed, epoch)
        per_step = self.cfg.batch_size * self.world
        start = index * per_step + self.rank * self.cfg.batch_size
        # Wraps around when there are fewer records than one step needs (every rank gets a full batch).
        return [order[(start + i) % len(order)] for i in range(self.cfg.batch_size)]

    def _forward(self, batch):
        batch = batch.to(self.device)
        teacher = self.teacher(batch, torch.bfloat16 if self.gpu else torch.float32)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.gpu):
            return self.ddp(batch, teacher)

    def train_step(self, batch) -> tuple[torch.Tensor, float]:
        """One step; a non-finite loss or gradient norm (on any rank) skips the update on every rank:
        `step_finite`, `step_loss` (mean over ranks) and `step_lr` say how the step went."""
        self.model.train()
        self.optim.zero_grad(set_to_none=True)  # before the forward: last step's grads are not held through it
        loss, stats = self._forward(batch)
        loss.backward()
        grad_norm = clip_gradients(self.optim, self.model.trainable_parameters(), self.cfg.grad_clip or 1e9)
        # One host sync for both values; the sum over ranks stays non-finite if any rank's is.
        values = self._all_reduce(torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float()]))
        loss_value, grad_value = (v / self.world for v in values.tolist())
        self.step_loss, self.step_lr = loss_value, self.optim.param_groups[0]["lr"]
        self.step_finite = math.isfinite(loss_value) and math.isfinite(grad_value)
        if self.step_finite:
            self.optim.step()
        else:
            self.optim.zero_grad(set_to_none=True)  # not applied: NaN/inf would spread into every weight
        self.optim.grad_scale = None  # type: ignore[attr-defined]  # this step's clipping scale
        self.sched.step()
        self.step += 1
        return stats, grad_value

    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.trainable_parameters())

    def _nonfinite_failure(self, first_step: int, streak: int, grad_norm: float) -> TrainError:
        """Log and report the stop for non-finite values; returns the error to raise."""
        latest = ckpt.latest(self.out_dir) if self.is_main else None
        resume = (f"it resumes from the checkpoint of step {latest['step']}, taken before this" if latest
                  else "no checkpoint was taken, it starts again")
        steps = f"step {first_step}" if streak == 1 else f"steps {first_step}-{self.step}"
        message = (f"training stopped at step {self.step}: loss {self.step_loss:.4g}, grad norm {grad_norm:.4g} "
                   f"(lr {self.step_lr:.3g}) for {streak} step{'s' if streak != 1 else ''} in a row ({steps}, "
                   "not applied, nothing checkpointed): lower train.learning_rate "
                   f"(now {self.cfg.learning_rate:g}) or set train.grad_clip, then `eagle3-console run train` "
                   f"({resume})")
        values = {"step": self.step, "first_step": first_step, "streak": streak, "loss": self.step_loss,
                  "grad_norm": grad_norm, "lr": self.step_lr}
        self.metric({"type": "failed", "t": time.time(), "reason": "nonfinite", **values, "message": message})
        self.event("nonfinite", **values, message=message)
        return TrainError(message)

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        entries = self.data.eval_entries[self.rank::self.world]
        if not self.data.eval_entries:
            return None
        self.model.eval()
        total = None
        for i in range(0, len(entries), self.cfg.batch_size):
            _, stats = self._forward(self.data.collate(entries[i:i + self.cfg.batch_size]))
            total = stats if total is None else total + stats
        if total is None:
            total = torch.zeros(self.cfg.ttt_steps, len(STAT_FIELDS), device=self.device)
        total = self._all_reduce(total)
        return summarize(total)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            torch.distributed.all_reduce(tensor)
        return tensor

    def _stop_asked(self) -> bool:
        return self.stop_requested or bool(self.ctx is not None and self.ctx.stop_requested)

    def _stop_before_next_batch(self, batches: BatchPrefetcher) -> bool:
        """Wait for the next batch unless a stop is asked meanwhile (True then: every rank stops at this step).
        Online, a batch can wait for the server without end (stopped, or restarted by hand): a stop must
        not. With several ranks the wait is a vote every half second, so a stop reaches all of them at the
        same step whichever ones are still waiting: a rank leaving its wait alone would meet the others'
        gradient all-reduce with its stop vote. Once every batch is there it is the step's one vote."""
        while True:
            ready = batches.wait(0.5)
            if self.world == 1:
                if self._stop_asked():
                    return True
                if ready:
                    return False
                continue
            votes = torch.tensor([1.0 if self._stop_asked() else 0.0, 0.0 if ready else 1.0], device=self.device)
            stop, waiting = self._all_reduce(votes).tolist()
            if stop > 0:
                return True
            if waiting == 0:
                return False

    def _eval_and_best(self, train_summary: dict | None) -> None:
        if self.nonfinite_streak or not self.weights_finite():
            # Same answer on every rank (the step flag is reduced, the weights are replicated): nobody
            # evaluates, nothing non-finite becomes a checkpoint, let alone the best one.
            self.event("checkpoint_skipped", step=self.step, reason="non-finite loss, gradients or weights")
            return
        summary = self.evaluate()
        if summary is not None and not math.isfinite(summary["loss"]):
            # Finite but huge weights (a far too high learning rate) overflow in the forward: the eval
            # says so before the next step does. Logged, not checkpointed.
            self.metric({"type": "eval", "step": self.step, "epoch": self.step / self.steps_per_epoch,
                         "t": time.time(), **summary})
            self.event("checkpoint_skipped", step=self.step, reason=f"eval loss {summary['loss']}")
            return
        source = summary or train_summary
        if summary is not None:
            self.metric({"type": "eval", "step": self.step, "epoch": self.step / self.steps_per_epoch,
                         "t": time.time(), **summary})
            self.event("eval", step=self.step, sim_al=summary["sim_al"], loss=summary["loss"])
        improved = self.is_main and source is not None and source["sim_al"] > self.best_sim_al
        if improved and source is not None:
            self.best_sim_al, self.best_step = source["sim_al"], self.step
        self.save_checkpoint()  # carries the best so far: a resumed run compares against it
        if improved:
            ckpt.mark_best(self.out_dir, self.step, self.best_sim_al)
        if self.is_main:
            ckpt.prune(self.out_dir)

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        """Train from the start or the latest checkpoint; one writer per drafter directory."""
        lock = None
        if self.is_main:
            from engine.workspace import WorkspaceLock

            self.out_dir.mkdir(parents=True, exist_ok=True)
            lock = WorkspaceLock(self.out_dir, ckpt.TRAIN_LOCK)
            if not lock.acquire(wait_s=1.0):
                raise TrainError(f"{self.out_dir} is being trained by {lock.holder_text('another process')}: "
                                 "wait for that job or stop it (`eagle3-console jobs stop ID`), or set train.run to a new name")
            swept = ckpt.sweep_dead_temp_files(self.out_dir)  # lock held: no live writer owns them
            if swept:
                self.event("swept_temp", count=swept)
        try:
            return self._run()
        finally:
            try:
                if self.online and isinstance(getattr(self, "data", None), RecordData):
                    self.event("window", **self.data.close())  # stream/ emptied; kept/ stays
            except OSError as exc:
                # Its note (data.json) and event are figures: a full disk here must not replace the run's
                # own outcome, its error and fix or its export.
                print(f"warning: online window closed without its note: {exc}", file=sys.stderr, flush=True)
            finally:
                if lock is not None:
                    lock.release()

    def _run(self) -> int:
        self.setup()
        self.event("started", step=self.step, total_steps=self.total_steps, train=len(self.data.train_entries),
                   eval=len(self.data.eval_entries), device=str(self.device), world=self.world, backend=self.backend,
                   **{**self._data_position(), **(self.data.plan_fields() if self.online else {})})
        limit = self.total_steps if self.max_steps is None else min(self.total_steps, self.step + self.max_steps)
        window, grad_norm, last_summary = None, 0.0, None
        tokens = torch.zeros((), dtype=torch.int64, device=self.device)  # summed on the device: read at log lines
        self.nonfinite_streak, first_nonfinite = 0, 0  # 0: no non-finite step yet
        t0 = time.perf_counter()
        saved_at = self.step
        self._start_stream(limit)
        # The next steps' records are read, hashed and padded (into pinned memory on CUDA) on a thread and
        # copied to the GPU under the previous step (a step's batch is a pure function of the step
        # number, so resume replays the same batches).
        load = lambda step: self.data.collate(self._batch_entries(step), pin=self.gpu)  # noqa: E731
        interrupt = self.data.interrupt if self.online else None  # a stop while a batch awaits captures
        with BatchPrefetcher(load, range(self.step, limit), self.device, interrupt=interrupt) as batches:
            while self.step < limit:
                if self._stop_before_next_batch(batches):
                    self._sum_window_figures()
                    if not self.nonfinite_streak and self.weights_finite():
                        self.save_checkpoint()
                    self.event("stopped", step=self.step)
                    return 0
                batch = next(batches)
                stats, grad_norm = self.train_step(batch)
                if self.step_finite:
                    self.nonfinite_streak, first_nonfinite = 0, 0
                else:
                    self.nonfinite_streak += 1
                    first_nonfinite = first_nonfinite or self.step
                window = stats if window is None else window + stats
                tokens += batch.lengths.sum()
                if self.step % self.cfg.log_every == 0 or self.step == limit:
                    window = self._all_reduce(window)
                    self._sum_window_figures()
                    elapsed = time.perf_counter() - t0
                    summary = summarize(window)
                    last_summary = summary
                    rate = int(tokens) * self.world / max(elapsed, 1e-9)
                    self.metric({"type": "train", "step": self.step, "epoch": self.step / self.steps_per_epoch,
                                 "t": time.time(), "lr": self.sched.get_last_lr()[0], "grad_norm": grad_norm,
                                 "tokens_per_s": rate, **summary})
                    if self.ctx is not None and self.is_main:
                        self.ctx.progress(self.step, self.total_steps, loss=round(summary["loss"], 4),
                                          sim_al=round(summary["sim_al"], 3), tokens_per_s=round(rate, 1),
                                          **self._data_progress())
                    window, t0 = None, time.perf_counter()
                    tokens.zero_()
                if self.nonfinite_streak >= NONFINITE_LIMIT:
                    raise self._nonfinite_failure(first_nonfinite, self.nonfinite_streak, grad_norm)
                if self.step % self.cfg.save_every == 0:
                    self._eval_and_best(last_summary)
                    saved_at = self.step
        self._sum_window_figures()
        if self.nonfinite_streak and self.step >= self.total_steps:
            raise self._nonfinite_failure(first_nonfinite, self.nonfinite_streak, grad_norm)  # never export it
        if saved_at != self.step:
            self._eval_and_best(last_summary)
        if self.step >= self.total_steps:
            self.export()
        return 0

    def export(self) -> Path | None:
        """Export the best checkpoint (by simulated acceptance length), else the current weights."""
        from engine.train.export import ExportError, export_drafter

        if not self.is_main:
            return None
        marker = ckpt.best(self.out_dir)
        model, rejected = self.model, None
        if marker:
            try:
                state = ckpt.load(self.out_dir, marker["path"])
            except (ckpt.CheckpointError, FileNotFoundError) as exc:
                # Damaged since it was saved: the current (finite, checked again below) weights instead.
                rejected = f"best checkpoint {marker['path']} not exported: {exc}; exported the weights of step {self.step}"
                self.event("checkpoint_rejected", path=marker["path"], message=rejected)
                marker = None
            else:
                model = Eagle3Drafter(self.model.cfg)
                model.load_state_dict({**state["model"], "embed_tokens.weight": self.model.embed_tokens.weight.cpu()})
        try:
            path = export_drafter(model, self.out_dir / "export", self.data.meta.get("model_weights"))
        except ExportError as exc:
            raise TrainError(str(exc)) from None
        self.event("finished", step=self.step, export=str(path), best_sim_al=self.best_sim_al,
                   best_step=(marker or {}).get("step"), **({"best_rejected": rejected} if rejected else {}))
        return path


def install_stop_handler(trainer: Trainer) -> None:
    """Without a job context (run by hand or as a torchrun rank) SIGTERM still means: checkpoint, then exit."""

    def on_signal(signum, frame):
        trainer.stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
