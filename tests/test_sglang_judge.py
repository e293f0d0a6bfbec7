"""SGLang 0.5.23's own code judges what we hand it: layer ids per architecture, and the export.

- Layer ids: tests/sglang_judge/layer_probe.py runs the wheel's real `set_eagle3_layers_to_capture`
  for every architecture that defines it (a table that grows with the wheel), for the ids our target
  plan emits. SGLang's `layers_to_capture` j captures the input of layer j (the output of layer j-1),
  so the layers it serves are `layers_to_capture - 1`; they must equal the layers our records hold.
- Export: tests/sglang_judge/load_export.py builds the wheel's real LlamaForCausalLMEagle3 on the CPU
  and loads our export through its real `load_weights`; every parameter must equal our drafter's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.model.target import (
    ADD_ONE,
    ADD_ONE_IF_FIRST_IS_ONE,
    KEYWORD_AUX,
    LayerIdRule,
    layer_id_rule,
    plan_target,
    served_layers,
    sglang_layer_ids,
)
from engine.train.export import export_drafter
from engine.train.model import DraftConfig, Eagle3Drafter
from engine.train.vocab import build_vocab
from sglang_judge.wheel import JUDGE_DIR, last_json_line, run_with_sglang

PROBE_LAYERS = 61  # a DeepSeek-V3 / Kimi-K2.5 depth; ids of shallower targets fit below it
# Capture layers (ours) to judge: the defaults for 61 (DeepSeek-V3, Kimi-K2.5), 32 (Llama-3.1-8B) and
# 16 (the demo) layers, and custom choices, including ones that start at 0 and at 1.
LAYER_SETS = [[1, 29, 57], [3, 30, 57], [1, 15, 28], [2, 16, 29], [1, 7, 12], [0, 10, 20], [5, 6, 7]]
# Handed on to a model class chosen at run time from another registry: not judgeable here.
UNJUDGEABLE = {"MindSporeForCausalLM": "delegates to a MindSpore model picked at run time"}


@pytest.fixture(scope="module")
def probe(sglang_importable) -> dict:
    id_lists = sorted({json.dumps(ids) for ours in LAYER_SETS for ids in (ours, [i + 1 for i in ours])})
    out = run_with_sglang(sglang_importable, JUDGE_DIR / "layer_probe.py", str(PROBE_LAYERS), *id_lists)
    data = last_json_line(out)
    data["id_lists"] = [json.loads(x) for x in id_lists]
    return data


def sglang_sets(probe: dict, architecture: str, ids: list[int]) -> list[int]:
    result = probe["architectures"][architecture]["results"][probe["id_lists"].index(ids)]
    assert not isinstance(result, str), result
    if isinstance(result, dict):  # handed to the inner decoder model, whose setter stores it as is
        result = result["handed_on_to_runtime_model"]
    return result


def test_our_rule_table_is_the_wheels(probe, sglang_src):
    """Every EAGLE-3 architecture in the wheel is in our table with its rule, and nothing else is."""
    probed = set(probe["architectures"]) - set(UNJUDGEABLE)
    assert probed == ADD_ONE | ADD_ONE_IF_FIRST_IS_ONE, (
        f"missing from engine/model/target.py: {sorted(probed - ADD_ONE - ADD_ONE_IF_FIRST_IS_ONE)}; "
        f"not EAGLE-3 targets in the wheel: {sorted((ADD_ONE | ADD_ONE_IF_FIRST_IS_ONE) - probed)}")
    assert set(probe["keyword_aux_without_method"]) == KEYWORD_AUX
    defining = {p.stem for p in (sglang_src / "models").glob("*.py")
                if "def set_eagle3_layers_to_capture" in p.read_text(encoding="utf-8")}
    assert defining and not defining & set(probe["import_failures"]), probe["import_failures"]
    assert len(probed) >= 60


@pytest.mark.parametrize("ours", LAYER_SETS, ids=lambda ours: "-".join(map(str, ours)))
def test_sglang_serves_the_layers_our_records_hold(probe, ours):
    judged = 0
    for architecture in sorted(set(probe["architectures"]) - set(UNJUDGEABLE)):
        try:
            ids = sglang_layer_ids(architecture, ours)
        except ValueError:
            # DeepSeek's rule shifts an id list starting at 1 again: layer 0 cannot come first.
            assert ours[0] == 0 and layer_id_rule(architecture) is LayerIdRule.ADD_ONE_IF_FIRST_IS_ONE
            continue
        served = [j - 1 for j in sglang_sets(probe, architecture, ids)]
        assert served == ours, f"{architecture}: ids {ids} serve layers {served}, records hold {ours}"
        assert served_layers(architecture, ids) == ours, architecture  # our reader agrees with SGLang
        judged += 1
    assert judged >= 45


def _config(path: Path, data: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("custom", [(), (3, 30, 57)])
def test_plans_for_real_target_shapes(probe, tmp_path, custom):
    """Llama-3.1-8B, DeepSeek-V3 and Kimi-K2.5 (text_config) shapes: plan ids served back as planned."""
    shapes = {
        "LlamaForCausalLM": {"num_hidden_layers": 32, "hidden_size": 4096, "vocab_size": 128256},
        "DeepseekV3ForCausalLM": {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 129280},
        "KimiK25ForConditionalGeneration": {"text_config": {"num_hidden_layers": 61, "hidden_size": 7168,
                                                            "vocab_size": 163840}},
    }
    for architecture, fields in shapes.items():
        model = _config(tmp_path / architecture, {"architectures": [architecture], **fields})
        layers = list(custom) if custom and architecture != "LlamaForCausalLM" else [2, 16, 29] if custom else []
        plan = plan_target(model, layers)
        served = [j - 1 for j in sglang_sets(probe, architecture, plan.sglang_ids)]
        assert served == list(plan.capture_layers), (architecture, plan.describe_layers())
    kimi = plan_target(tmp_path / "KimiK25ForConditionalGeneration")
    assert kimi.num_layers == 61 and kimi.text_config_key == "text_config" and kimi.hidden_size == 7168


def test_export_loads_through_sglangs_own_loader(sglang_importable, tmp_path):
    cfg = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
                      vocab_size=300, draft_vocab_size=50, target_hidden_size=96, aux_layers_sglang=[1, 7, 12])
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # norms too, so a weight SGLang left at its init value shows
    vocab = build_vocab(torch.randint(0, 100, (300,)), 50)
    model.set_vocab(vocab.d2t, vocab.t2d)
    out = export_drafter(model, tmp_path / "export")
    run_with_sglang(sglang_importable, JUDGE_DIR / "load_export.py", str(out), str(tmp_path / "sglang.pt"))
    loaded = torch.load(tmp_path / "sglang.pt", weights_only=True)
    params, hot = loaded["params"], loaded["hot_token_id"]

    ours = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    expected = {
        "model.fc.weight": ours["fc.weight"],
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat(
            [ours[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]),
        "model.layers.0.self_attn.o_proj.weight": ours["midlayer.self_attn.o_proj.weight"],
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat(
            [ours["midlayer.mlp.gate_proj.weight"], ours["midlayer.mlp.up_proj.weight"]]),
        "model.layers.0.mlp.down_proj.weight": ours["midlayer.mlp.down_proj.weight"],
        "model.layers.0.input_layernorm.weight": ours["midlayer.input_layernorm.weight"],
        "model.layers.0.post_attention_layernorm.weight": ours["midlayer.post_attention_layernorm.weight"],
        "model.layers.0.hidden_norm.weight": ours["midlayer.hidden_norm.weight"],
        "model.norm.weight": ours["norm.weight"],
        "lm_head.weight": ours["lm_head.weight"],
    }
    assert set(params) - set(expected) == {"model.embed_tokens.weight"}, sorted(params)  # the target's, at serve
    for name, want in expected.items():
        got = params[name].float()[: want.shape[0]]  # SGLang pads lm_head rows to a multiple of 64
        assert got.shape == want.shape and torch.equal(got, want), name
    assert torch.equal(hot, vocab.hot_ids), "SGLang's hot_token_id must be our draft-to-target map"
