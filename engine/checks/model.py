"""Stage `model`: path, config.json, shapes, capture layers in range, tokenizer + chat template."""

from __future__ import annotations

import json
from pathlib import Path

from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext
from engine.dataset.tokenize import chat_token_ids
from engine.model.weights_id import readable_weights_id
from engine.model.target import (SIZE_FIELDS, LayerIdRule, TargetError, config_sizes, layer_id_rule, plan_target,
                           text_config)


def _weights_evidence(model_dir: Path) -> tuple[bool, str]:
    if (model_dir / "model.safetensors.index.json").is_file():
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        files = sorted(set(index.get("weight_map", {}).values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            return False, f"index lists {len(files)} shards, missing: {', '.join(missing[:3])}"
        return True, f"{len(files)} safetensors shards"
    single = model_dir / "model.safetensors"
    if single.is_file():
        return True, f"model.safetensors ({single.stat().st_size / 2**20:.1f} MiB)"
    bins = sorted(model_dir.glob("*.bin"))
    if bins:
        return True, f"{len(bins)} .bin file(s)"
    return False, "no model.safetensors, shard index or .bin weights"


def check_model(ctx: CheckContext) -> list[CheckResult]:
    cfg = ctx.config
    if not cfg.model.path:
        return [failed("path", "model.path is empty in console.toml", "set model.path to the target model directory")]
    model_dir = ctx.workspace.path(cfg.model.path)
    if not model_dir.is_dir():
        return [failed("path", f"{model_dir} does not exist", "set model.path to an existing HF model directory")]
    results = [passed("path", str(model_dir))]

    try:
        text = text_config(model_dir)
    except TargetError as exc:
        return results + [failed("config", str(exc), "point model.path at a complete Hugging Face model directory")]
    sizes = config_sizes(text)
    if sizes is None:
        return results + [failed("config", ", ".join(f"{name}={text.get(name)}" for name in SIZE_FIELDS),
                                 "config.json must give positive integers for these three fields")]
    layers, hidden, vocab = sizes
    architecture = (text.get("architectures") or ["?"])[0]
    results.append(passed("config", f"{architecture}: {layers} layers, hidden {hidden}, vocab {vocab}"))

    ok, evidence = _weights_evidence(model_dir)
    weights = readable_weights_id(model_dir) if ok else None
    if weights:  # the id records, exports, reports and the server record name: compare by eye
        evidence += f", weights id {weights}"
    results.append(passed("weights", evidence) if ok else failed("weights", evidence, "download the complete checkpoint"))

    try:
        plan = plan_target(model_dir, list(cfg.model.capture_layers))
    except TargetError as exc:
        first = " (the first 1 or more: this architecture's SGLang rule shifts a list starting at 1 again)" \
            if layer_id_rule(architecture) is LayerIdRule.ADD_ONE_IF_FIRST_IS_ONE else ""
        results.append(failed("capture_layers", str(exc),
                              f"use three increasing ids in 0..{layers - 2}{first}, or [] for the default"))
    else:
        results.append(passed("capture_layers", plan.describe_layers()))
        refusal = plan.sglang_refusal() if cfg.model.backend == "sglang" else None
        if refusal:
            results.append(failed("sglang_capture", refusal, "set model.backend = \"local\""))
    results.append(_tokenizer_check(model_dir))
    if ctx.config.model.backend == "sglang":
        from engine.checks.sglang import check_sglang_model

        results += check_sglang_model(ctx)
    return results


def _tokenizer_check(model_dir: Path) -> CheckResult:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        return failed("tokenizer", f"tokenizer did not load: {type(exc).__name__}: {str(exc)[:200]}",
                      "the model directory needs tokenizer.json or the tokenizer files of its family")
    if not getattr(tok, "chat_template", None):
        return failed("tokenizer", f"{type(tok).__name__} loaded, no chat template",
                      "add the serving chat template (tokenizer_config.json 'chat_template') — training data must be "
                      "tokenised exactly as the server will see it")
    try:
        ids = chat_token_ids(tok, [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}])
    except Exception as exc:
        return failed("tokenizer", f"chat template failed to render: {exc}", "fix the chat template")
    if not ids:
        return warned("tokenizer", "chat template rendered zero tokens", "check the chat template")
    return passed("tokenizer", f"{type(tok).__name__}, {len(tok)} tokens, chat template renders ({len(ids)} tokens for a 2-turn probe)")
