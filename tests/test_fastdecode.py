"""The lean decode path of the evaluation: the fast Llama runner reproduces transformers (logits,
aux states, greedy output), speculative decoding on it equals greedy, unsupported models fall back.

Real tiny Llamas in float32 on CPU: the checkpoint from conftest (GQA, 4 heads / 2 KV heads) and
random-init configs built here (MHA, 1 KV head, llama3 RoPE, tied embeddings, attention bias).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engine.evaluate.fastllama import (  # noqa: E402
    FAST_ENV,
    FastLlama,
    try_fast_target,
    unsupported_reason,
)
from engine.evaluate.specdec import DraftRunner, aux_features, greedy_decode, speculative_decode  # noqa: E402
from tests.helpers.drafters import AUX, make_drafter, training_attention_reference  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_llama(seed: int = 0, **changes):
    """A 4-layer random Llama (hidden 64, vocab 300) with weights N(0, 0.2), so greedy output varies."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=4096,
                    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    settings.update(changes)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("fast_target"))
    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
VARIANTS = {
    "mha": dict(num_key_value_heads=4),
    "one_kv_head": dict(),
    "llama3_rope_tied": dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
}


def hf_reference(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return out.logits, out.hidden_states


def assert_close(got, want, what):
    assert got.shape == want.shape, what
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"{what}: max diff {(got - want).abs().max():.2e}"


def check_runner_against_hf(model):
    """Prefill, incremental steps, a multi-token step after cropping: logits and every aux layer."""
    runner = try_fast_target(model)
    assert isinstance(runner, FastLlama)
    layers = list(range(model.config.num_hidden_layers))  # 0 (embeddings) .. L-1
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=gen)
    logits, hidden = hf_reference(model, ids)
    want_aux = aux_features(hidden, layers)
    with torch.inference_mode():
        got, aux = runner.forward(ids[:, :20], 0, layers, all_logits=True)
        assert_close(got, logits[:, :20], "prefill logits")
        assert_close(aux, want_aux[:, :20], "prefill aux")
        last, none = runner.forward(ids[:, :20], 0)
        assert none is None
        assert_close(last, logits[:, 19:20], "last-position logits")
        for pos in range(20, 24):  # one token at a time
            got, aux = runner.forward(ids[:, pos:pos + 1], pos, [3, 1])
            assert_close(got, logits[:, pos:pos + 1], f"step {pos} logits")
            assert_close(aux, aux_features(hidden, [3, 1])[:, pos:pos + 1], f"step {pos} aux")
        # Crop back to 22 (just a smaller start position), then a verify-like 5-token step.
        got, aux = runner.forward(ids[:, 22:27], 22, AUX, all_logits=True)
        assert_close(got, logits[:, 22:27], "verify logits after crop")
        assert_close(aux, aux_features(hidden, AUX)[:, 22:27], "verify aux after crop")


def test_runner_equals_transformers_on_the_checkpoint(checkpoint):
    assert checkpoint.config.num_attention_heads != checkpoint.config.num_key_value_heads
    check_runner_against_hf(checkpoint)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_runner_equals_transformers_on_variants(variant):
    check_runner_against_hf(random_llama(**VARIANTS[variant]))


def test_runner_grows_past_its_first_capacity():
    model = random_llama(num_hidden_layers=2)
    runner = try_fast_target(model)
    first = runner.capacity
    ids = torch.randint(0, 300, (1, first + 40), generator=torch.Generator().manual_seed(2))
    logits, _ = hf_reference(model, ids)
    with torch.inference_mode():
        runner.forward(ids[:, : first - 3], 0)
        got, _ = runner.forward(ids[:, first - 3: first + 5], first - 3, all_logits=True)  # crosses the end
        assert runner.capacity > first
        assert_close(got, logits[:, first - 3: first + 5], "logits across the growth")
        got, _ = runner.forward(ids[:, first + 5: first + 6], first + 5)
        assert_close(got, logits[:, first + 5: first + 6], "step after the growth")


def test_runner_is_built_once_shares_weights_and_follows_edits(checkpoint):
    runner = try_fast_target(checkpoint)
    assert try_fast_target(checkpoint) is runner
    layer = checkpoint.model.layers[0]
    assert layer.self_attn.k_proj.weight.data_ptr() > runner.qkv[0].data_ptr()  # a view into the fused weight
    ids = torch.tensor([[7, 19, 33, 2, 150, 61]])
    before = greedy_decode(checkpoint, ids[0].tolist(), 12).tokens
    saved = [layer.self_attn.k_proj.weight.detach().clone(), layer.mlp.up_proj.weight.detach().clone()]
    with torch.no_grad():
        layer.self_attn.k_proj.weight.mul_(-1.5)  # in place: seen through the shared storage
        layer.mlp.up_proj.weight.mul_(0.5)
    try:
        assert try_fast_target(checkpoint) is runner
        check_runner_against_hf(checkpoint)
        after = greedy_decode(checkpoint, ids[0].tolist(), 12).tokens
        assert after != before
    finally:
        with torch.no_grad():
            layer.self_attn.k_proj.weight.copy_(saved[0])
            layer.mlp.up_proj.weight.copy_(saved[1])
    assert greedy_decode(checkpoint, ids[0].tolist(), 12).tokens == before


def test_replaced_weights_make_a_new_runner():
    model = random_llama()
    runner = try_fast_target(model)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.data = torch.randn_like(
            model.model.layers[1].self_attn.v_proj.weight) * 0.2
    fresh = try_fast_target(model)
    assert fresh is not runner
    check_runner_against_hf(model)


def _generate(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         pad_token_id=0)
    completion = out[0, len(prompt):].tolist()
    assert len(completion) == n  # no end-of-sequence token cut it short
    return completion


def test_greedy_equals_generate_on_the_fast_path(checkpoint):
    assert try_fast_target(checkpoint) is not None
    for prompt in PROMPTS:
        tokens = greedy_decode(checkpoint, prompt, 30).tokens
        assert tokens == _generate(checkpoint, prompt, 30)
        assert len(set(tokens)) > 5


@pytest.mark.parametrize("steps", [1, 4])
def test_speculative_equals_greedy_on_the_fast_path(checkpoint, steps):
    drafter = make_drafter(checkpoint, seed=steps)
    for prompt in PROMPTS:
        base = greedy_decode(checkpoint, prompt, 40)
        spec = speculative_decode(checkpoint, drafter, prompt, 40, steps, AUX)
        assert spec.tokens == base.tokens
        assert spec.verify_steps >= (40 - 1) // (steps + 1)
    stop = base.tokens[9]
    cut = speculative_decode(checkpoint, drafter, PROMPTS[-1], 40, steps, AUX, [stop])
    assert cut.tokens == base.tokens[: base.tokens.index(stop) + 1]


def test_fast_and_transformers_paths_decode_the_same(checkpoint, monkeypatch):
    drafter = make_drafter(checkpoint, seed=5)
    fast = [(greedy_decode(checkpoint, p, 30).tokens, speculative_decode(checkpoint, drafter, p, 30, 3, AUX))
            for p in PROMPTS]
    monkeypatch.setenv(FAST_ENV, "0")
    assert try_fast_target(checkpoint) is None
    for prompt, (base, spec) in zip(PROMPTS, fast):
        assert greedy_decode(checkpoint, prompt, 30).tokens == base
        slow = speculative_decode(checkpoint, drafter, prompt, 30, 3, AUX)
        assert (slow.tokens, slow.verify_steps, slow.accepted) == (spec.tokens, spec.verify_steps, spec.accepted)


def test_one_host_sync_per_verify_step(checkpoint, monkeypatch):
    """Drafts stay on the device: the only tensor-to-Python reads are the prefill's token and one
    read per verify step."""
    drafter = make_drafter(checkpoint, seed=3)
    reads = []
    for name in ("__int__", "__index__", "__float__", "__bool__", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    spec = speculative_decode(checkpoint, drafter, PROMPTS[0], 30, 3, AUX)
    monkeypatch.undo()
    assert spec.verify_steps > 5
    assert len(reads) == spec.verify_steps + 1, reads


@pytest.mark.parametrize("change, reason", [
    (dict(attention_bias=True), "bias"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rope type"),
])
def test_unsupported_models_fall_back_to_transformers(change, reason):
    model = random_llama(seed=4, num_key_value_heads=2, **change)
    assert reason in unsupported_reason(model)
    assert try_fast_target(model) is None
    drafter = make_drafter(model, seed=1)
    for prompt in PROMPTS[:2]:
        base = greedy_decode(model, prompt, 24)
        assert base.tokens == _generate(model, prompt, 24)
        assert speculative_decode(model, drafter, prompt, 24, 3, AUX).tokens == base.tokens


def test_draft_runner_grows_and_keeps_the_training_attention(checkpoint):
    """A runner started with a tiny capacity grows mid-chain and still gives draft_logits' values."""
    drafter = make_drafter(checkpoint)
    ids, aux, reference = training_attention_reference(checkpoint, drafter)
    with torch.inference_mode():
        runner = DraftRunner(drafter, capacity=4)
        first = runner.capacity
        hidden = runner.extend(ids[:, 1:11], drafter.project(aux[:, :10]))[:, -1:]
        assert runner.capacity > first
        for k in range(3):
            assert_close(drafter.logits(hidden)[0, -1], reference[k][0, 9], f"chain step {k}")
            token = runner.propose_token(hidden)
            assert token.shape == (1, 1) and int(token) == runner.propose(hidden)
            assert bool(drafter.t2d[token[0, 0]])  # a target id from the draft vocabulary
            hidden = runner.extend(ids[:, 11 + k:12 + k], hidden)


def test_cudnn_attention_is_turned_off_for_decoding_unless_asked_to_stay(monkeypatch):
    """Decode steps change the key length every step; cuDNN attention builds a plan per shape (an H200
    evaluation measured speculative decoding 5x slower than greedy). The flag is process-wide in torch."""
    from engine.model.sdpa import CUDNN_SDPA_ENV, avoid_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        monkeypatch.setenv(CUDNN_SDPA_ENV, "1")
        assert avoid_cudnn_attention("cuda") is False
        assert torch.backends.cuda.cudnn_sdp_enabled() is True
        monkeypatch.delenv(CUDNN_SDPA_ENV)
        assert avoid_cudnn_attention("cpu") is False  # a CPU process keeps its settings
        assert torch.backends.cuda.cudnn_sdp_enabled() is True
        assert avoid_cudnn_attention("cuda:0") is True
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_offset_causal_picks_the_mask_form_by_device():
    """One token needs no mask and a prefill from 0 is SDPA's own is_causal; several tokens after a
    prefix need query i to see keys 0..start+i: an explicit mask on CPU, a lower-right causal bias on CUDA."""
    from torch.nn.attention.bias import CausalBias

    from engine.evaluate.fastllama import causal_offset_mask, offset_causal

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert offset_causal(1, 7, cpu) is None and offset_causal(1, 7, cuda) is None
    assert offset_causal(5, 0, cpu) is None and offset_causal(5, 0, cuda) is None
    mask = offset_causal(3, 2, cpu)
    assert mask.tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]
    assert torch.equal(mask, causal_offset_mask(3, 2, cpu))
    bias = offset_causal(3, 2, cuda)  # built lazily: no CUDA call until SDPA runs it
    assert isinstance(bias, CausalBias) and (bias.seq_len_q, bias.seq_len_kv) == (3, 5)
    assert torch.equal(bias._materialize(cpu), mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: flash attention with a lower-right causal bias")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lower_right_attention_equals_the_explicit_mask_cuda(dtype):
    """The verify step's attention (4 new tokens after a cached prefix, GQA) gives the same output through
    the lower-right bias (flash in bf16, memory-efficient in fp32) as through the boolean mask."""
    from engine.evaluate import fastllama
    from engine.evaluate.fastllama import attend, offset_causal, rope_tables

    torch.manual_seed(0)
    heads, kv, hd, start, t = 8, 2, 64, 37, 4
    qkv = torch.randn(t, (heads + 2 * kv) * hd, device="cuda", dtype=dtype)
    cos, sin = rope_tables(torch.rand(hd // 2, device="cuda"), 64, dtype)
    cached_keys = torch.randn(1, kv, 64, hd, device="cuda", dtype=dtype)
    cached_values = torch.randn(1, kv, 64, hd, device="cuda", dtype=dtype)
    outs = []
    for lower_right in (True, False):
        keys, values = cached_keys.clone(), cached_values.clone()  # attend writes the new k/v into them
        fastllama.LOWER_RIGHT_CAUSAL = lower_right
        try:
            mask = offset_causal(t, start, torch.device("cuda"))
            outs.append(attend(qkv, keys, values, start, cos[start:start + t], sin[start:start + t], heads, kv, hd, mask))
        finally:
            fastllama.LOWER_RIGHT_CAUSAL = True
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (outs[0].float() - outs[1].float()).abs().max().item() < tolerance
