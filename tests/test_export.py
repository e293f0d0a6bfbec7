"""The export's weight names and shapes equal what SGLang's EAGLE-3 loader consumes.

Expected names are derived by reading sgl-project/sglang
python/sglang/srt/models/llama_eagle3.py at commit 03d5a7771f6082e7737a5f19cae7d1e863087013:
  * LlamaForCausalLMEagle3 holds `model` (LlamaModel) and `lm_head` (ParallelLMHead of
    draft_vocab_size rows when tie_word_embeddings is false);
  * LlamaModel has `embed_tokens` (replaced by the target's at serve time), `fc` (Linear
    3*target_hidden_size -> hidden, bias only if config.bias), `midlayer` (decoder layer with
    `self_attn.qkv_proj` taking 2*hidden, `self_attn.o_proj`, `mlp.gate_up_proj`, `mlp.down_proj`,
    `input_layernorm`, `hidden_norm`, `post_attention_layernorm`) and `norm`;
  * load_weights: a name containing "d2t" becomes hot_token_id (= d2t + arange), "t2d" is skipped,
    q/k/v_proj stack into qkv_proj and gate/up_proj into gate_up_proj, a name not in params_dict
    gets a "model." prefix, and a name that still matches nothing is silently skipped.
The test re-applies that mapping to our export and requires every parameter except embed_tokens to be
loaded with the right shape, and no name to be skipped.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.train.export import check_export, export_drafter, load_export, sglang_expected_shapes
from engine.train.model import DraftConfig, Eagle3Drafter
from engine.train.vocab import build_vocab

STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


def sglang_params(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """named_parameters() of SGLang's LlamaForCausalLMEagle3 (TP=1), from the source above."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    return {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.fc.weight": (h, 3 * cfg.target_hidden_size),
        "model.midlayer.self_attn.qkv_proj.weight": (q + 2 * kv, 2 * h),
        "model.midlayer.self_attn.o_proj.weight": (h, q),
        "model.midlayer.mlp.gate_up_proj.weight": (2 * inter, h),
        "model.midlayer.mlp.down_proj.weight": (h, inter),
        "model.midlayer.input_layernorm.weight": (h,),
        "model.midlayer.hidden_norm.weight": (h,),
        "model.midlayer.post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
    }


def simulate_sglang_load(cfg: DraftConfig, weights: dict[str, torch.Tensor]):
    """Replays load_weights' name handling; returns (loaded rows per param, hot_token_id, skipped)."""
    params = sglang_params(cfg)
    loaded: dict[str, int] = {}
    skipped, hot = [], None
    for name, tensor in weights.items():
        if "d2t" in name:
            hot = tensor + torch.arange(tensor.shape[0])
            continue
        if "t2d" in name:
            continue
        for param_name, shard_name, _ in STACKED:
            if shard_name not in name:
                continue
            name = name.replace(shard_name, param_name)
            target = f"model.{name}" if name not in params else name
            if target in params:
                assert tensor.shape[1:] == params[target][1:], name
                loaded[target] = loaded.get(target, 0) + tensor.shape[0]
            else:
                skipped.append(name)
            break
        else:
            target = name if name in params else f"model.{name}"
            if target in params:
                assert tuple(tensor.shape) == params[target], (name, tensor.shape, params[target])
                loaded[target] = loaded.get(target, 0) + tensor.shape[0]
            else:
                skipped.append(name)
    return params, loaded, hot, skipped


@pytest.mark.parametrize("target_hidden", [64, 96])
def test_export_matches_sglang_loader(tmp_path, target_hidden):
    cfg = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
                      vocab_size=300, draft_vocab_size=50, target_hidden_size=target_hidden,
                      aux_layers_sglang=[2, 3, 1])
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg)
    counts = torch.randint(0, 100, (300,))
    vocab = build_vocab(counts, 50)
    model.set_vocab(vocab.d2t, vocab.t2d)
    out = export_drafter(model, tmp_path / "export")
    assert check_export(out) == []

    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(sglang_expected_shapes(cfg))
    params, loaded, hot, skipped = simulate_sglang_load(cfg, weights)
    assert skipped == []
    for name, shape in params.items():
        if name == "model.embed_tokens.weight":
            assert name not in loaded  # SGLang installs the target's embedding
            continue
        assert loaded.get(name) == shape[0], f"{name}: loaded {loaded.get(name)} rows of {shape[0]}"
    assert weights["d2t"].dtype == torch.int64
    assert torch.equal(hot, torch.nonzero(vocab.t2d).flatten())
    top = torch.argsort(-counts, stable=True)[:50]
    assert set(hot.tolist()) == set(top.tolist())  # draft ids map back to the most frequent target tokens
    assert all(w.dtype == torch.bfloat16 for n, w in weights.items() if n not in ("d2t", "t2d"))

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    for key, value in {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "intermediate_size": 160, "num_hidden_layers": 1, "hidden_act": "silu",
                       "torch_dtype": "bfloat16", "vocab_size": 300, "draft_vocab_size": 50,
                       "target_hidden_size": target_hidden}.items():
        assert config[key] == value, key
    for key in ("rms_norm_eps", "rope_theta", "max_position_embeddings"):
        assert key in config
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 1]

    embed = torch.randn(300, 64)
    model.embed_tokens.weight.data.copy_(embed)
    reloaded = load_export(out, embed_tokens=embed)
    ids = torch.randint(0, 300, (1, 12))
    aux = torch.randn(1, 12, 3 * target_hidden)
    for a, b in zip(model.draft_logits(ids, aux, steps=2), reloaded.draft_logits(ids, aux, steps=2)):
        assert torch.allclose(a, b, atol=0.05, rtol=0.05)


def test_check_export_catches_wrong_names_and_config(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = DraftConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                      vocab_size=100, draft_vocab_size=20, aux_layers_sglang=[2, 3, 1])
    out = export_drafter(Eagle3Drafter(cfg), tmp_path / "export")
    weights = load_file(str(out / "model.safetensors"))
    weights["layers.0.mlp.down_proj.weight"] = weights.pop("midlayer.mlp.down_proj.weight")
    save_file(weights, str(out / "model.safetensors"))
    problems = check_export(out)
    assert any("lack midlayer.mlp.down_proj.weight" in p for p in problems)
    assert any("silently skips" in p for p in problems)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    del config["eagle_config"]
    (out / "config.json").write_text(json.dumps(config))
    problems = check_export(out)
    assert any("LlamaForCausalLMEagle3" in p for p in problems)
    assert any("eagle_aux_hidden_state_layer_ids" in p for p in problems)
    with pytest.raises(ValueError):
        load_export(out)


def test_ttt_attention_backends_agree():
    """The memory-linear sdpa backend equals the dense-mask reference, values and gradients."""
    from engine.train.attention import ttt_attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 21, 8, requires_grad=True)
    ks = [torch.randn(2, 2, 21, 8, requires_grad=True) for _ in range(3)]
    vs = [torch.randn(2, 2, 21, 8, requires_grad=True) for _ in range(3)]
    weight = torch.randn(2, 4, 21, 8)
    results = []
    for backend in ("sdpa", "dense"):
        out = ttt_attention(q, ks, vs, backend)
        grads = torch.autograd.grad((out * weight).sum(), [q, *ks, *vs])
        results.append((out, grads))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.allclose(a, b, atol=1e-5)
