"""Checking and loading the transformers model directory the local server serves."""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EngineError, one_line


class ModelLoadError(EngineError):
    """The model directory cannot be served; str() is the reason (one line)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the runner and /model_info need to know about the loaded model."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int | None
    model_type: str | None
    architectures: list[str]
    eos_token_ids: frozenset[int]
    pad_token_id: int
    cache_kw: str  # the forward's name for the KV cache argument
    has_logits_to_keep: bool


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any  # None: input_ids still work; text requests get a clear 400
    device: str
    info: ModelInfo


def check_model_dir(model_path: Path) -> None:
    if not model_path.exists():
        raise ModelLoadError("does not exist")
    if not model_path.is_dir():
        raise ModelLoadError("is not a directory (expected a transformers model directory)")
    from engine.model.target import TargetError, read_config

    if not (model_path / "config.json").is_file():
        raise ModelLoadError("has no config.json (not a transformers model directory)")
    try:
        read_config(model_path)
    except TargetError as exc:
        raise ModelLoadError(str(exc)) from None


def load_model(model_path: Path, requested_device: str, requested_dtype: str) -> LoadedModel:
    """Load model and tokenizer; ModelLoadError with a one-line reason on failure."""
    check_model_dir(model_path)
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # keep the server's stderr to its own messages
    hf_logging.disable_progress_bar()
    device = _resolve_device(torch, requested_device)
    host_threads(torch, device)
    try:
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"config.json cannot be loaded: {one_line(exc)}") from None
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[requested_dtype]
    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"
    model: Any  # transformers' typing of .to() and .float() does not take a device string
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, **{dtype_kw: dtype})
    except Exception as exc:
        raise ModelLoadError(f"cannot load the model ({one_line(exc)})") from None
    if device == "cpu" and model.dtype == torch.float16:
        model = model.float()  # fp16 kernels are poor or missing on CPU
    model = model.to(device).eval()
    from engine.model.sdpa import avoid_cudnn_attention

    avoid_cudnn_attention(device)  # decode steps change the key length: no per-shape plan builds
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except Exception:
        tokenizer = None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    eos_token_ids = _eos_ids(model, tokenizer)
    params = inspect.signature(model.forward).parameters
    info = ModelInfo(
        num_layers=int(text_config.num_hidden_layers),
        hidden_size=int(text_config.hidden_size),
        vocab_size=int(text_config.vocab_size),
        max_context=int(getattr(text_config, "max_position_embeddings", 0) or 0) or None,
        model_type=getattr(config, "model_type", None),
        architectures=list(getattr(config, "architectures", None) or []),
        eos_token_ids=eos_token_ids,
        pad_token_id=_pad_id(model, tokenizer, eos_token_ids),
        cache_kw="cache" if "cache" in params else "past_key_values",
        has_logits_to_keep="logits_to_keep" in params,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, info=info)


def _resolve_device(torch: Any, wanted: str) -> str:
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for, but torch sees no CUDA device")
    return wanted


def host_threads(torch: Any, device: str, environ: Mapping[str, str] | None = None) -> int:
    """On a GPU the server's torch work on the host is bookkeeping (ids, masks, a capture's small copies),
    and with a thread a core every such op wakes the whole OpenMP pool, whose threads then spin: one
    thread there, unless OMP_NUM_THREADS says otherwise (bench/RESULTS.md, Capture overhead, session 24).
    On a CPU the model itself runs on these threads: left as they are. Returns the count in force."""
    settings = os.environ if environ is None else environ
    if device == "cuda" and not settings.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    return int(torch.get_num_threads())


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None),
                   getattr(model.config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return frozenset(ids)


def _pad_id(model: Any, tokenizer: Any, eos_token_ids: frozenset[int]) -> int:
    for source in (getattr(tokenizer, "pad_token_id", None), getattr(model.config, "pad_token_id", None)):
        if isinstance(source, int):
            return source
    return min(eos_token_ids) if eos_token_ids else 0
