"""Local backend: the target (transformers) and the drafter export in this process, speculative
decoding against plain greedy decoding on the same prompts, in the same run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine.evaluate.prompts import EvalPrompt
from engine.evaluate.report import PromptResult, first_mismatch
from engine.errors import EngineError


class EvalError(EngineError):
    """Evaluation cannot run; the message names the cause and the fix."""


@dataclass
class LocalSetup:
    target: Any  # a transformers causal LM
    drafter: Any  # engine.train.model.Eagle3Drafter
    aux_layers: list[int]  # transformers hidden_states indices the served layers land on (ours + 1)
    stop_ids: list[int]
    device: str
    dtype: str
    notes: list[str]


def resolve_device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise EvalError("server.device is cuda but torch sees no CUDA device: set server.device = \"auto\"")
    if requested in ("auto", ""):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def resolve_dtype(requested: str, device: str):
    import torch

    if requested == "auto":
        return torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[requested]
    return torch.float32 if device == "cpu" and dtype == torch.float16 else dtype


def stop_token_ids(target, tokenizer) -> list[int]:
    ids: set[int] = set()
    for source in (getattr(getattr(target, "generation_config", None), "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return sorted(ids)


def run_layers(workspace) -> list[int] | None:
    """The decoder layers (ours) whose outputs the extraction captured (run.json), if there is a run."""
    try:
        meta = json.loads((workspace.hidden_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return [int(x) for x in meta.get("layers") or []] or None


def load_local(workspace, export_dir: Path, tokenizer) -> LocalSetup:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.evaluate.specdec import check_aux_layers
    from engine.model.sdpa import avoid_cudnn_attention
    from engine.model.target import TargetError, plan_target, served_layers
    from engine.train.export import ExportError, load_export

    cfg = workspace.config
    device = resolve_device(cfg.server.device)
    avoid_cudnn_attention(device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    import transformers

    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"  # renamed in 4.56
    try:
        target: Any = AutoModelForCausalLM.from_pretrained(str(workspace.model_dir), local_files_only=True,
                                                           **{dtype_kw: dtype})
    except Exception as exc:  # transformers raises many types for a broken directory
        raise EvalError(f"cannot load the target from {workspace.model_dir} ({type(exc).__name__}: {exc}); "
                        "fix the `model` stage first") from None
    target = target.to(device).eval()
    embed = target.get_input_embeddings().weight.detach()
    try:
        drafter = load_export(export_dir, embed_tokens=embed)
    except ExportError as exc:
        raise EvalError(f"the drafter export is unusable: {exc}; re-run the train stage") from None
    if drafter.cfg.vocab_size != embed.shape[0] or drafter.cfg.target_hidden_size != embed.shape[1]:
        raise EvalError(f"the drafter was built for a target with vocab {drafter.cfg.vocab_size} and hidden "
                        f"{drafter.cfg.target_hidden_size}, this target has {tuple(embed.shape)}: retrain it")
    drafter = drafter.to(device=device, dtype=dtype).eval()
    drafter.d2t.data = drafter.d2t.data.to(torch.int64)  # buffers keep their integer dtype
    try:
        plan = plan_target(workspace.model_dir)
    except TargetError as exc:
        raise EvalError(f"{exc}; fix the `model` stage first") from None
    # Read the export as SGLang does: its ids through the target architecture's rule.
    ids = [int(x) for x in drafter.cfg.aux_layers_sglang]
    served = served_layers(plan.architecture, ids)
    extracted = run_layers(workspace)
    if extracted is not None and extracted != served:
        raise EvalError(f"the drafter export's layer ids {ids} make SGLang serve the outputs of decoder layers "
                        f"{served} on {plan.architecture}, but its records hold layers {extracted}: the export "
                        "would feed the drafter the wrong layers; re-run the train stage")
    try:
        layers = check_aux_layers([x + 1 for x in served], plan.num_layers)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    notes = []
    notes.append(f"export layer ids {ids} -> SGLang serves outputs of decoder layers {served} on "
                 f"{plan.architecture} ({plan.rule.value}) = transformers hidden_states{layers}")
    from engine.evaluate.fastllama import unsupported_reason

    why = unsupported_reason(target)
    notes.append("target runner: lean static-cache runner (both sides)" if why is None
                 else f"target runner: transformers, both sides ({why})")
    return LocalSetup(target, drafter, layers, stop_token_ids(target, tokenizer), device,
                      str(dtype).replace("torch.", ""), notes)


def evaluate_local(setup: LocalSetup, prompts: list[EvalPrompt], max_new_tokens: int, num_steps: int,
                   progress: Callable[[int, PromptResult], None] | None = None,
                   should_stop: Callable[[], bool] | None = None) -> list[PromptResult]:
    """Per prompt: greedy baseline then speculative decoding, both timed, outputs compared."""
    from engine.evaluate.specdec import greedy_decode, speculative_decode

    t, d = setup.target, setup.drafter
    # Warm-up (untimed): first-call allocations and kernel selection must not count against either.
    warm = prompts[0].input_ids
    greedy_decode(t, warm, min(8, max_new_tokens), setup.stop_ids)
    speculative_decode(t, d, warm, min(8, max_new_tokens), num_steps, setup.aux_layers, setup.stop_ids)
    results = []
    for i, prompt in enumerate(prompts):
        if should_stop is not None and should_stop():
            break
        base = greedy_decode(t, prompt.input_ids, max_new_tokens, setup.stop_ids)
        spec = speculative_decode(t, d, prompt.input_ids, max_new_tokens, num_steps, setup.aux_layers,
                                  setup.stop_ids)
        mismatch = first_mismatch(spec.tokens, base.tokens)
        result = PromptResult(
            id=prompt.id, prompt_tokens=len(prompt.input_ids), completion_tokens=len(spec.tokens),
            verify_steps=spec.verify_steps, accepted=list(spec.accepted), spec_seconds=spec.seconds,
            base_seconds=base.seconds, base_completion_tokens=len(base.tokens),
            matches_greedy=mismatch is None, first_mismatch=mismatch)
        results.append(result)
        if progress is not None:
            progress(i + 1, result)
    return results


def precision_note(dtype: str, results: list[PromptResult]) -> str | None:
    """Why speculative output can differ from greedy in half precision, when it does."""
    differ = [r for r in results if r.matches_greedy is False]
    if not differ or dtype not in ("bfloat16", "float16"):
        return None
    return (f"{len(differ)} of {len(results)} outputs differ from greedy: in {dtype} a verify step (several "
            "tokens in one forward) rounds differently from one-token decoding, so near-tie tokens can flip "
            "and the texts part from there. In float32 (model.dtype) the outputs match token for token")


# ----------------------------------------------------------------------------- measurement with its noise


@dataclass
class Run:
    """One request decoded one way: its tokens, latency and (speculative) verify counts."""

    tokens: list[int]
    seconds: float
    verify_steps: int = 0
    accepted: list[int] | None = None


def _single(setup: LocalSetup, prompts, max_new_tokens: int, steps: int | None) -> list[Run]:
    from engine.evaluate.specdec import greedy_decode, speculative_decode

    (prompt,) = prompts
    if steps is None:
        r = greedy_decode(setup.target, prompt, max_new_tokens, setup.stop_ids)
        return [Run(r.tokens, r.seconds)]
    r = speculative_decode(setup.target, setup.drafter, prompt, max_new_tokens, steps, setup.aux_layers,
                           setup.stop_ids)
    return [Run(r.tokens, r.seconds, r.verify_steps, list(r.accepted))]


def _wave(setup: LocalSetup, prompts, max_new_tokens: int, steps: int | None) -> list[Run]:
    """All `prompts` in flight together (one static batch); batch 1 uses the batch-1 decoders."""
    from engine.evaluate.batched import batched_greedy, batched_speculative

    if len(prompts) == 1:
        return _single(setup, prompts, max_new_tokens, steps)
    if steps is None:
        return [Run(r.tokens, r.seconds) for r in batched_greedy(setup.target, prompts, max_new_tokens,
                                                                   setup.stop_ids)]
    return [Run(r.tokens, r.seconds, r.verify_steps, list(r.accepted)) for r in batched_speculative(
        setup.target, setup.drafter, prompts, max_new_tokens, steps, setup.aux_layers, setup.stop_ids)]


def choose_cpu_threads(device: str) -> str | None:
    """On a CPU, run torch on the cores that are idle now (at least 1), unless OMP_NUM_THREADS says
    otherwise: with more threads than free cores, torch's threads spin-wait on each other and a step
    takes several times longer at random, which widens the speedup's interval. Both sides run with
    the same count.
    Returns a note for the report, or None (GPU, or left as set)."""
    import os

    import torch

    if device != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    cpus = os.cpu_count() or 1
    idle = int(cpus - os.getloadavg()[0])
    before = torch.get_num_threads()
    threads = max(1, min(before, idle))
    if threads != before:
        torch.set_num_threads(threads)
    return (f"CPU threads: {threads} of {cpus} (the cores idle at the start by the load average; "
            "OMP_NUM_THREADS overrides)")


def plan_levels(levels: list[int], num_prompts: int) -> tuple[list[int], list[str]]:
    """The concurrency levels that can be measured with `num_prompts` prompts, and notes on the rest."""
    bad = [x for x in levels if not isinstance(x, int) or not 1 <= x <= 1024]
    if bad:
        raise EvalError(f"evaluate.concurrency {levels} holds {bad}: each level is a number of requests in flight "
                        "from 1 to 1024, e.g. concurrency = [1, 4, 16]")
    wanted = sorted(set(levels)) or [1]
    kept = [x for x in wanted if x <= num_prompts]
    notes = []
    skipped = [x for x in wanted if x > num_prompts]
    if skipped:
        notes.append(f"concurrency {', '.join(map(str, skipped))} skipped: {num_prompts} prompts cannot keep that "
                     "many requests in flight (raise evaluate.num_prompts)")
    if not kept:
        kept = [num_prompts]
        notes.append(f"measured at concurrency {num_prompts} instead")
    return kept, notes


def measure_local(setup: LocalSetup, prompts: list[EvalPrompt], max_new_tokens: int, *, spec_steps: int,
                  sweep_steps: list[int], rounds: int, levels: list[int],
                  progress: Callable[[dict], None] | None = None,
                  should_stop: Callable[[], bool] | None = None) -> dict:
    """Warm-up, then per level, round and wave: the baseline and every speculative setting, in an
    order that rotates per round and wave (so drift and load bursts fall on both sides alike).

    Returns {"levels": [engine.evaluate.report.level_summary(...)], "prompt_results": per prompt of
    the first level at spec_steps (summed over rounds), "load": {...}, "notes": [...], "done": n}."""
    import os

    from engine.evaluate.report import Tally, level_summary

    settings = sorted({int(spec_steps), *(int(s) for s in sweep_steps)})
    bad = [s for s in settings if not 1 <= s <= 64]
    if bad:
        raise EvalError(f"evaluate.sweep_steps {sweep_steps} holds {bad}: speculative steps run from 1 to 64")
    levels, notes = plan_levels(levels, len(prompts))
    ids = [p.input_ids for p in prompts]
    cpus = os.cpu_count() or 1
    load = {"before": os.getloadavg()[0], "cpus": cpus}
    peak = load["before"]
    # Warm-up (untimed): allocations, kernel selection and the first-call paths of every runner.
    for n in levels:
        wave = ids[:n]
        _wave(setup, wave, min(8, max_new_tokens), None)
        for steps in settings:
            _wave(setup, wave, min(8, max_new_tokens), steps)
    total = sum((len(ids) // n) * n for n in levels) * rounds
    done = 0
    out_levels = []
    per_prompt: dict[int, list] = {}
    stopped = False
    for n in levels:
        waves = [list(range(w * n, (w + 1) * n)) for w in range(len(ids) // n)]
        tallies = {s: Tally() for s in settings}
        for r in range(rounds):
            for w, members in enumerate(waves):
                if should_stop is not None and should_stop():
                    stopped = True
                    break
                order: list[int | None] = [None] + settings
                shift = (r + w) % len(order)
                order = order[shift:] + order[:shift]
                runs: dict[int | None, list[Run]] = {}
                for side in order:
                    runs[side] = _wave(setup, [ids[i] for i in members], max_new_tokens, side)
                base = runs[None]
                for steps in settings:
                    for i, b, s in zip(members, base, runs[steps]):
                        tallies[steps].add(b.tokens, b.seconds, s.tokens, s.seconds, s.verify_steps, s.accepted or [])
                        if n == levels[0] and steps == spec_steps:
                            per_prompt.setdefault(i, []).append((b, s))
                for steps in settings:
                    tallies[steps].wave_walls.append((max(x.seconds for x in base),
                                                      max(x.seconds for x in runs[steps])))
                done += len(members)
                peak = max(peak, os.getloadavg()[0])
                if progress is not None:
                    t = tallies[spec_steps]
                    progress({"done": done, "total": total, "concurrency": n, "round": r + 1, "rounds": rounds,
                              "acceptance_length": t.acceptance_length(), "speedup": t.running_median()})
            if stopped:
                break
        if any(t.samples for t in tallies.values()):
            out_levels.append(level_summary(n, spec_steps, {s: t for s, t in tallies.items()}, len(waves), rounds))
        if stopped:
            break
    load.update(after=os.getloadavg()[0], max=max(peak, os.getloadavg()[0]))
    results = []
    for i in sorted(per_prompt):
        pairs = per_prompt[i]
        base_tokens, spec_tokens = pairs[0][0].tokens, pairs[0][1].tokens
        mismatch = first_mismatch(spec_tokens, base_tokens)
        width = max(len(s.accepted or []) for _, s in pairs)
        results.append(PromptResult(
            id=prompts[i].id, prompt_tokens=len(ids[i]), completion_tokens=sum(len(s.tokens) for _, s in pairs),
            verify_steps=sum(s.verify_steps for _, s in pairs),
            accepted=[sum((s.accepted or [0] * width)[k] for _, s in pairs) for k in range(width)],
            spec_seconds=sum(s.seconds for _, s in pairs), base_seconds=sum(b.seconds for b, _ in pairs),
            base_completion_tokens=sum(len(b.tokens) for b, _ in pairs),
            matches_greedy=all(s.tokens == b.tokens for b, s in pairs), first_mismatch=mismatch))
    return {"levels": out_levels, "prompt_results": results, "load": load, "notes": notes, "done": done,
            "total": total, "stopped": stopped}
