"""Load only the target's LM head from its checkpoint: one file, sharded with an index, or tied.

Reading one tensor with safetensors' lazy loader keeps this cheap even for a 1T-parameter
target: the capture probe and the trainer's teacher need the head, not the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from engine.errors import EngineError

HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")
EMBED_NAMES = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight", "embed_tokens.weight",
               "model.language_model.embed_tokens.weight")


class LmHeadError(EngineError):
    pass


def _tied(model_dir: Path) -> bool:
    from engine.model.target import TargetError, text_config

    try:
        return bool(text_config(model_dir).get("tie_word_embeddings", False))
    except TargetError:
        return False


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return {name: single for name in handle.keys()}
    raise LmHeadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json "
                      "(convert .bin checkpoints to safetensors first)")


def load_lm_head(model_dir: Path | str):
    """The LM head weight [vocab, hidden] as stored (bf16/fp16/fp32 tensor)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = tensor_files(model_dir)
    candidates = list(HEAD_NAMES) + (list(EMBED_NAMES) if _tied(model_dir) else [])
    for name in candidates:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as handle:
                return handle.get_tensor(name)
    # Untied checkpoints that omit lm_head (rare) fall back to the embedding only when tied.
    raise LmHeadError(f"{model_dir}: no LM head tensor (looked for {', '.join(candidates)}); "
                      "is this a causal LM checkpoint?")
