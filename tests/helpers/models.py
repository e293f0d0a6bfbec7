"""Model directories for tests: a tiny real checkpoint, a config-only one."""

from __future__ import annotations

import json
from pathlib import Path

TINY_CORPUS = [
    "The capital city of France is Paris.",
    "EAGLE-3 drafts tokens from the target model's hidden states.",
    "Speculative decoding verifies several draft tokens in one forward pass.",
    "A small model makes the whole pipeline run on a laptop.",
    "hello world, hello tokens, hello hidden states",
    "0123456789 + - * / = ( ) [ ] { } < > ; : ' \" ? !",
]

# A chat template with {% generation %} blocks (the assistant mask) and a generation prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}</s>{% endgeneration %}{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def build_tiny_model(target: Path, seed: int = 0) -> Path:
    """Write a 4-layer Llama (hidden 64) and a tiny BPE tokenizer into `target`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(target)

    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default init so greedy decoding is not a constant token (makes tests meaningful).
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
        # Special tokens get logit 0 while ~300 random logits spread around 0: greedy decoding
        # practically never emits EOS, so generations reach max_new_tokens (stop is tested
        # through stop_token_ids).
        model.lm_head.weight[[fast.bos_token_id, fast.eos_token_id, fast.pad_token_id]] = 0.0
    model.save_pretrained(target)
    return target


def write_min_model(path: Path) -> Path:
    """A config.json-only model: enough for the disk budget (the model stage itself may fail)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 300,
    }))
    return path


def fine_tune_in_place(model_dir: Path) -> None:
    """What a fine-tune saved over a target looks like from outside: the same config, tokenizer, tensor names
    and shapes; other numbers."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = {name: (t.float() * 1.01 + 1e-3).to(t.dtype) for name, t in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
