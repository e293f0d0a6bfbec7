"""The target's config sizes and chat-template token ids, read once (engine.model.target,
engine.dataset.tokenize) and used by the model check and the capture probe."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from engine.checks.context import CheckContext
from engine.checks.model import check_model
from engine.config import set_value
from engine.dataset.tokenize import chat_token_ids
from engine.model.target import TargetError, bad_sizes, config_sizes, plan_target
from engine.workspace import init_workspace

GOOD = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 100}


def model_dir(tmp_path, **changes):
    path = tmp_path / "m"
    path.mkdir(exist_ok=True)
    config = {k: v for k, v in {**GOOD, **changes}.items() if v is not None}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_sizes_are_positive_integers_and_a_json_true_is_not_one():
    assert config_sizes(GOOD) == (8, 64, 100)
    bad = {**GOOD, "num_hidden_layers": True, "hidden_size": 0}
    del bad["vocab_size"]
    assert config_sizes(bad) is None
    assert bad_sizes(bad) == ["num_hidden_layers=True", "hidden_size=0", "vocab_size=None"]
    assert config_sizes({**GOOD, "vocab_size": 100.0}) is None


def test_plan_names_every_bad_size(tmp_path):
    with pytest.raises(TargetError) as info:
        plan_target(model_dir(tmp_path, num_hidden_layers=True, hidden_size=-1))
    message = str(info.value)
    assert "num_hidden_layers=True, hidden_size=-1;" in message and "vocab_size" in message
    plan = plan_target(model_dir(tmp_path))
    assert (plan.num_layers, plan.hidden_size, plan.vocab_size) == (8, 64, 100)


def test_model_check_reports_bad_sizes_and_stops(tmp_path):
    ws = init_workspace(tmp_path / "ws")
    ws.save_config(set_value(ws.config, "model.path", str(model_dir(tmp_path, hidden_size=True))))
    results = check_model(CheckContext(ws))
    assert results[-1].name == "config" and results[-1].status.value == "fail"
    assert "hidden_size=True" in results[-1].evidence
    assert not [r for r in results if r.name == "capture_layers"]  # nothing is planned on bad sizes


def test_model_check_names_the_weights_id_the_other_stages_compare(tiny_chat_model_dir, tmp_path):
    from engine.model.weights_id import weights_id

    ws = init_workspace(tmp_path / "ws")
    ws.save_config(set_value(ws.config, "model.path", str(tiny_chat_model_dir)))
    [weights] = [r for r in check_model(CheckContext(ws)) if r.name == "weights"]
    assert weights.status.value == "pass"
    assert weights.evidence.endswith(f", weights id {weights_id(tiny_chat_model_dir)}"), weights.evidence


def test_chat_token_ids_are_the_templates_ids(tiny_chat_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(tiny_chat_model_dir), local_files_only=True)
    messages = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
    ids = chat_token_ids(tok, messages)
    assert ids and all(type(i) is int for i in ids)
    assert ids == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    prompt = chat_token_ids(tok, messages[:1], add_generation_prompt=True)
    assert tok.decode(prompt).endswith("assistant: ")
    # The model check renders the same probe through it.
    ws = init_workspace(tmp_path / "ws")
    ws.save_config(set_value(ws.config, "model.path", str(tiny_chat_model_dir)))
    [tokenizer] = [r for r in check_model(CheckContext(ws)) if r.name == "tokenizer"]
    assert tokenizer.status.value == "pass" and f"({len(ids)} tokens for a 2-turn probe)" in tokenizer.evidence
