"""Demo content: real dataset files, a real trained tokenizer and a real tiny Llama, on CPU.

The full demo is built once per test session (conftest's demo_content, shared with the demo workspace
tests); the other builds here use 3 training steps.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # everything must load from local files
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from engine.demo import DEMO_MODEL_NAME, create_demo_content, build_demo_model, write_demo_dataset  # noqa: E402
from engine.demo.corpus import FACTS, read_conversations  # noqa: E402


@pytest.fixture(scope="session")
def demo(demo_content):
    """The session's demo content (conftest: built once, shared with the console's demo tests)."""
    return demo_content


@pytest.fixture(scope="session")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo[1].model.path, local_files_only=True)


@pytest.fixture(scope="session")
def model(demo):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo[1].model.path, local_files_only=True).eval()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _user_key(conv):
    return tuple(m["content"] for m in conv if m["role"] == "user")


def test_dataset_files_parse_with_counts_and_disjoint_eval(demo):
    ws, content, _ = demo
    assert content.dataset.train == ws / "data" / "train.jsonl"
    assert content.dataset.eval == ws / "data" / "eval.jsonl"
    splits = {}
    for name, path in (("train", content.dataset.train), ("eval", content.dataset.eval)):
        lines = path.read_text(encoding="utf-8").splitlines()
        convs = [json.loads(line)["messages"] for line in lines]
        for conv in convs:
            roles = [m["role"] for m in conv]
            body = roles[1:] if roles[0] == "system" else roles
            assert body == ["user", "assistant"] * (len(body) // 2) and body, roles
            assert all(isinstance(m["content"], str) and m["content"] for m in conv)
        splits[name] = convs
    assert len(splits["train"]) == content.dataset.n_train == 400
    assert len(splits["eval"]) == content.dataset.n_eval == 40
    multi_turn = [c for c in splits["train"] if sum(m["role"] == "assistant" for m in c) > 1]
    assert len(multi_turn) >= 40
    assert any(c[0]["role"] == "system" for c in splits["train"])
    train_keys = {_user_key(c) for c in splits["train"]}
    assert not train_keys & {_user_key(c) for c in splits["eval"]}
    assert len(train_keys) == 400  # no duplicate prompts within train either


def test_dataset_is_deterministic(tmp_path):
    first = write_demo_dataset(tmp_path / "a")
    second = write_demo_dataset(tmp_path / "b")
    assert first.train.read_bytes() == second.train.read_bytes()
    assert first.eval.read_bytes() == second.eval.read_bytes()


def test_model_dir_is_a_complete_hf_directory(demo):
    ws, content, messages = demo
    path = ws / "models" / DEMO_MODEL_NAME
    assert content.model.path == path
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    assert not [p for p in path.parent.iterdir() if p.name != DEMO_MODEL_NAME]  # no partial dirs left
    assert path.stat().st_mode & 0o777 == 0o755
    assert (path / "model.safetensors").stat().st_mode & 0o777 == 0o644
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == content.model.num_layers == 16
    assert config["hidden_size"] == content.model.hidden_size == 128
    assert config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == 2048
    assert config["torch_dtype"] == "float32" and config["rope_theta"] == 10000.0  # transformers 4.x spelling
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "{% generation %}" in tokenizer_config["chat_template"]
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["additional_special_tokens"] == ["<|system|>", "<|user|>", "<|assistant|>"]
    assert any("training demo target: step" in m for m in messages)


def test_tokenizer_loads_offline_and_renders_chat(tokenizer, demo):
    assert len(tokenizer) == demo[1].model.vocab_size
    assert 512 <= len(tokenizer) <= 2048
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|begin|>", "<|end|>", "<|pad|>")
    assert {"<|system|>", "<|user|>", "<|assistant|>"} <= set(tokenizer.all_special_tokens)
    conv = read_conversations(demo[1].dataset.train)[0]
    prompt_msgs = conv[: next(i for i, m in enumerate(conv) if m["role"] == "assistant")]
    prompt = tokenizer.apply_chat_template(prompt_msgs, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|begin|>") and prompt.endswith("<|assistant|>")
    assert f"<|user|>{prompt_msgs[-1]['content']}<|end|>" in prompt
    # The generation prompt tokenizes to an exact prefix of the whole conversation.
    prompt_ids = tokenizer.apply_chat_template(prompt_msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    full_ids = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
    assert full_ids[: len(prompt_ids)] == prompt_ids
    with pytest.raises(Exception, match="unknown role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_assistant_mask_marks_exactly_the_assistant_turns(tokenizer):
    conv = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 12 + 7?"},
        {"role": "assistant", "content": "12 + 7 = 19."},
        {"role": "user", "content": "Now multiply that by 2."},
        {"role": "assistant", "content": "19 * 2 = 38."},
    ]
    out = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    spans, current = [], []
    for token, flag in zip(ids, mask):
        if flag:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    decoded = [tokenizer.decode(span) for span in spans]
    assert decoded == ["12 + 7 = 19.<|end|>", "19 * 2 = 38.<|end|>"]
    # Each span starts right after an <|assistant|> token.
    assistant_id = tokenizer.convert_tokens_to_ids("<|assistant|>")
    starts = [i for i in range(1, len(ids)) if mask[i] and not mask[i - 1]]
    assert [ids[i - 1] for i in starts] == [assistant_id, assistant_id]


def test_training_reduced_loss_well_below_uniform(demo, model):
    info = demo[1].model
    uniform = math.log(info.vocab_size)
    assert info.initial_loss > 0.8 * uniform  # started near chance
    assert info.final_loss < 0.5 * uniform
    assert info.final_loss < info.initial_loss - 3.0
    assert model.config.vocab_size == info.vocab_size
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_greedy_generation_reproduces_train_answers(tokenizer, model, demo):
    """The tiny model is under-trained on purpose (seconds of CPU): it learns the answer
    templates and some facts, so the checks are on the whole sample, not every answer."""
    import torch

    convs = read_conversations(demo[1].dataset.train)
    fact_answers = {answer for answer, _ in FACTS}
    facts = [c for c in convs if c[-1]["content"] in fact_answers][:8]
    others = [c for c in convs if c[-1]["content"] not in fact_answers][:8]
    overlaps, stopped, exact_facts = [], 0, 0
    for conv in facts + others:
        k = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
        inputs = tokenizer.apply_chat_template(conv[:k], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=48, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert len(set(new)) >= min(4, len(new)), tokenizer.decode(new)  # no loop of a few tokens (a short answer may end early)
        stopped += tokenizer.eos_token_id in new
        text = tokenizer.decode(new, skip_special_tokens=True).strip()
        exact_facts += conv in facts and text == conv[k]["content"]
        want = set(conv[k]["content"].replace(".", " ").split())
        got = set(text.replace(".", " ").split())
        overlaps.append(len(want & got) / len(want))
    n = len(overlaps)
    assert stopped >= 0.75 * n  # learned to end its turn with <|end|>
    assert sum(o > 0 for o in overlaps) >= 0.75 * n, overlaps  # shares words with the expected answer
    assert sum(overlaps) / n >= 0.4, overlaps
    assert exact_facts >= 1  # memorised at least one fact verbatim


def test_same_seed_gives_identical_weights(demo, tmp_path):
    train = demo[1].dataset.train
    a = build_demo_model(tmp_path / "a", train, seed=0, steps=3)
    b = build_demo_model(tmp_path / "b", train, seed=0, steps=3)
    c = build_demo_model(tmp_path / "c", train, seed=1, steps=3)
    assert _sha256(a.path / "model.safetensors") == _sha256(b.path / "model.safetensors")
    assert _sha256(a.path / "tokenizer.json") == _sha256(b.path / "tokenizer.json")
    assert _sha256(a.path / "model.safetensors") != _sha256(c.path / "model.safetensors")


def test_interrupted_build_leaves_no_model_dir(demo, tmp_path):
    def interrupt(message: str) -> None:
        if "training demo target: step" in message:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_demo_model(tmp_path / "models" / "m", demo[1].dataset.train, steps=3, progress=interrupt)
    assert list((tmp_path / "models").iterdir()) == []


def test_existing_content_is_reused_never_overwritten(demo):
    ws, content, _ = demo
    before = {p: _sha256(p) for p in (content.dataset.train, content.dataset.eval, content.model.path / "model.safetensors")}
    again = create_demo_content(ws)
    assert again.dataset_reused and again.model_reused
    assert again.model.vocab_size == content.model.vocab_size
    assert {p: _sha256(p) for p in before} == before
    with pytest.raises(FileExistsError, match="already exists"):
        build_demo_model(content.model.path, content.dataset.train, steps=1)
