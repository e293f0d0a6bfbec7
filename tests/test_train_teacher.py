"""The teacher (engine.train.data.Teacher): the target's LM head on the captured final states, its greedy
token over the full vocabulary and its distribution over the draft vocabulary, from bf16 logits without
a full-vocabulary fp32 copy: exactly what fp32 logits give, ties and chunking included."""

from __future__ import annotations

import pytest
import torch

from engine.train.data import Batch, Teacher


def _reference(hidden: torch.Tensor, head: torch.Tensor, hot: torch.Tensor):
    logits = (hidden.reshape(-1, hidden.shape[-1]).to(head.dtype) @ head.T).float()
    return logits.argmax(-1), torch.softmax(logits[:, hot], -1)


@pytest.mark.parametrize("chunk_rows", [4096, 5])
def test_bf16_teacher_equals_the_fp32_logits_formula(chunk_rows):
    generator = torch.Generator().manual_seed(11)
    vocab, hidden_size, b, t = 300, 32, 2, 9
    head = (torch.randn(vocab, hidden_size, generator=generator) * 0.5).to(torch.bfloat16)
    head[7] = head[250]  # a tie: two vocabulary rows give the same logit everywhere; the first must win
    hot = torch.sort(torch.randperm(vocab, generator=generator)[:64]).values
    hot[0] = 7
    hidden = torch.randn(b, t, hidden_size, generator=generator)
    hidden[0, 0] = head[250].float() * 40  # its greedy token is the tie
    batch = Batch(input_ids=torch.zeros(b, t, dtype=torch.int64), loss_mask=torch.ones(b, t, dtype=torch.bool),
                  aux=torch.zeros(b, t, 3 * hidden_size), hidden=hidden, lengths=torch.tensor([t, t - 2]))
    out = Teacher(head, hot, chunk_rows=chunk_rows)(batch)
    greedy, probs = _reference(hidden, head, hot)
    assert greedy[0] == 7
    assert torch.equal(out.probs.reshape(-1, hot.shape[0]), probs)
    to_draft = torch.full((vocab,), -1, dtype=torch.int64)
    to_draft[hot] = torch.arange(hot.shape[0])
    assert torch.equal(out.target.reshape(-1), to_draft[greedy])
    assert out.target[0, 0] == 0 and (out.target == -1).any()


def test_keep_scores_the_next_loss_masked_token_inside_the_record_and_comes_to_the_host_too():
    b, t, hidden_size = 2, 6, 8
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    batch = Batch(input_ids=torch.zeros(b, t, dtype=torch.int64), loss_mask=loss_mask,
                  aux=torch.zeros(b, t, 3 * hidden_size), hidden=torch.randn(b, t, hidden_size),
                  lengths=torch.tensor([t, 4]))
    out = Teacher(torch.randn(20, hidden_size), torch.arange(10))(batch)
    # position s scores token s+1: masked in, and s+1 inside the record (the second one is 4 tokens long)
    want = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(out.keep, want)
    assert out.keep_host is not None and out.keep_host.device.type == "cpu" and torch.equal(out.keep_host, want)



def test_the_compiled_draft_softmax_traces_to_the_eager_teacher(monkeypatch):
    """On CUDA the draft columns' gather, widening, softmax and narrowing are one compiled function; here
    dynamo traces it (aot_eager: inductor's CPU build takes longer than this file may) and the teacher must
    give exactly the eager result, for one chunk and for several."""
    from engine.train import data, mixed

    calls = []
    real_compile = torch.compile

    def aot_eager(fn, **kwargs):
        calls.append(fn.__name__)
        return real_compile(fn, backend="aot_eager", **kwargs)

    generator = torch.Generator().manual_seed(5)
    head = (torch.randn(300, 32, generator=generator) * 0.5).to(torch.bfloat16)
    hot = torch.sort(torch.randperm(300, generator=generator)[:64]).values
    batch = Batch(input_ids=torch.zeros(2, 9, dtype=torch.int64), loss_mask=torch.ones(2, 9, dtype=torch.bool),
                  aux=torch.zeros(2, 9, 96), hidden=torch.randn(2, 9, 32, generator=generator),
                  lengths=torch.tensor([9, 7]))
    eager = [Teacher(head, hot, chunk_rows=rows)(batch, torch.bfloat16) for rows in (4096, 5)]
    monkeypatch.setattr(mixed, "_BROKEN", [])
    monkeypatch.setattr(mixed, "COMPILE_DEVICES", ("cpu",))
    monkeypatch.setattr(torch, "compile", aot_eager)
    monkeypatch.setattr(data, "_draft_softmax_kernel", mixed.compiled_or_eager(data._draft_softmax))
    for rows, want in zip((4096, 5), eager):
        got = Teacher(head, hot, chunk_rows=rows)(batch, torch.bfloat16)
        assert got.probs.dtype == torch.bfloat16 and got.probs.shape == (2, 9, 64)
        assert torch.equal(got.probs, want.probs) and torch.equal(got.target, want.target)
    assert calls == ["_draft_softmax"] and not mixed._BROKEN
