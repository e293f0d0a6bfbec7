"""SGLang-loadable export: `<drafter_dir>/export/{config.json, model.safetensors}`.

Weight names are exactly those SGLang's `LlamaForCausalLMEagle3.load_weights` maps onto its
parameters (python/sglang/srt/models/llama_eagle3.py): `fc.weight`, `midlayer.*`, `norm.weight`,
`lm_head.weight`, plus `d2t` (turned into hot_token_id) and `t2d` (explicitly ignored there,
kept for our own reload). `embed_tokens` is not exported: SGLang installs the target's.
SGLang silently skips unknown names, so `sglang_expected_shapes` + `check_export` compare the
file against what that loader needs; tests/test_export.py pins the names to the source.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine import atomic
from engine.train.model import DraftConfig, Eagle3Drafter

EXPORT_DIR = "export"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
ARCH = "LlamaForCausalLMEagle3"


class ExportError(ValueError):
    pass


def export_config(cfg: DraftConfig) -> dict:
    return {
        "architectures": [ARCH],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers_sglang),
                         "use_aux_hidden_state": True},
    }


def sglang_expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes the SGLang loader consumes (before it stacks q/k/v, gate/up)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    return {
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def export_tensors(model: Eagle3Drafter, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    out = {}
    for name in sglang_expected_shapes(model.cfg):
        tensor = state[name].detach().cpu()
        out[name] = tensor.contiguous() if name in ("d2t", "t2d") else tensor.to(dtype).contiguous()
    return out


def export_drafter(model: Eagle3Drafter, out_dir: Path) -> Path:
    """Write config.json and model.safetensors atomically (weights first: config marks it done)."""
    from safetensors.torch import save

    out_dir = Path(out_dir)
    tensors = export_tensors(model)
    atomic.write_bytes(out_dir / WEIGHTS, save(tensors, metadata={"format": "pt"}))
    atomic.write_json(out_dir / CONFIG, export_config(model.cfg))
    return out_dir


def config_from_export(data: dict) -> DraftConfig:
    try:
        return DraftConfig(
            hidden_size=data["hidden_size"], num_attention_heads=data["num_attention_heads"],
            num_key_value_heads=data["num_key_value_heads"], intermediate_size=data["intermediate_size"],
            vocab_size=data["vocab_size"], draft_vocab_size=data["draft_vocab_size"],
            target_hidden_size=data.get("target_hidden_size", data["hidden_size"]),
            head_dim=data.get("head_dim", 0), rms_norm_eps=data["rms_norm_eps"], rope_theta=data["rope_theta"],
            max_position_embeddings=data["max_position_embeddings"],
            aux_layers_sglang=(data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", []),
        )
    except KeyError as exc:
        raise ExportError(f"config.json lacks {exc.args[0]}") from None


def check_export(out_dir: Path) -> list[str]:
    """Problems that would make SGLang serve a wrong or random drafter; [] when the export is right."""
    from safetensors import safe_open

    out_dir = Path(out_dir)
    try:
        data = json.loads((out_dir / CONFIG).read_text())
    except FileNotFoundError:
        return [f"{out_dir / CONFIG} missing"]
    except ValueError as exc:
        return [f"{out_dir / CONFIG} unreadable ({exc})"]
    problems = []
    if data.get("architectures") != [ARCH]:
        problems.append(f"architectures is {data.get('architectures')}, SGLang needs [{ARCH!r}]")
    if data.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers is {data.get('num_hidden_layers')}, expected 1")
    layers = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not layers or len(layers) != 3:
        problems.append("eagle_config.eagle_aux_hidden_state_layer_ids missing: SGLang would guess the layers")
    try:
        cfg = config_from_export(data)
    except (ExportError, ValueError, TypeError, ZeroDivisionError) as exc:
        return problems + [str(exc)]
    expected = sglang_expected_shapes(cfg)
    try:
        with safe_open(str(out_dir / WEIGHTS), framework="pt") as handle:
            found = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except FileNotFoundError:
        return problems + [f"{out_dir / WEIGHTS} missing"]
    except Exception as exc:  # safetensors' own error types
        return problems + [f"{out_dir / WEIGHTS} unreadable ({exc})"]
    missing = sorted(set(expected) - set(found))
    unknown = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"weights lack {', '.join(missing)} (SGLang would keep random values)")
    if unknown:
        problems.append(f"unexpected weights {', '.join(unknown)} (SGLang silently skips them)")
    for name in sorted(set(expected) & set(found)):
        if found[name] != expected[name]:
            problems.append(f"{name}: shape {list(found[name])}, expected {list(expected[name])}")
    return problems


def load_export(out_dir: Path | str, embed_tokens: torch.Tensor | None = None) -> Eagle3Drafter:
    """Rebuild our model from an export (fp32). The embedding is the target's: pass it to run the model."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    problems = check_export(out_dir)
    if problems:
        raise ExportError(f"{out_dir}: " + "; ".join(problems))
    cfg = config_from_export(json.loads((out_dir / CONFIG).read_text()))
    model = Eagle3Drafter(cfg)
    tensors = load_file(str(out_dir / WEIGHTS))
    state = {k: (v if k in ("d2t", "t2d") else v.float()) for k, v in tensors.items()}
    if embed_tokens is not None:
        state["embed_tokens.weight"] = embed_tokens.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight"}, (missing, unexpected)
    return model
