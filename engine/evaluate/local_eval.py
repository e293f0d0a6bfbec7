"""Local backend: the target (transformers) and the drafter export in this process, speculative
decoding against plain greedy decoding on the same prompts, in the same run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.evaluate.prompts import EvalPrompt
from engine.evaluate.report import PromptResult, first_mismatch


class EvalError(Exception):
    """Evaluation cannot run; the message names the cause and the fix."""


@dataclass
class LocalSetup:
    target: object
    drafter: object
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
    from engine.sdpa import avoid_cudnn_attention
    from engine.target import TargetError, plan_target, served_layers
    from engine.train.export import ExportError, load_export

    cfg = workspace.config
    device = resolve_device(cfg.server.device)
    avoid_cudnn_attention(device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    import transformers

    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"  # renamed in 4.56
    try:
        target = AutoModelForCausalLM.from_pretrained(str(workspace.model_dir), local_files_only=True,
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
