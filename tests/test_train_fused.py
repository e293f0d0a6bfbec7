"""The fused head loss (engine.train.loss._FusedHeadLoss) against the checkpointed reference path:
loss, statistics and the gradient of every trainable parameter after a full TTTModel forward and
backward on a tiny drafter; plus the GPU-side choices of engine.train.loop (fused AdamW, bf16
embedding) that can be checked here. CUDA-only cases run where a GPU is present."""

from __future__ import annotations

import io

import pytest
import torch

from engine.train.data import Batch, TeacherOut
from engine.train.loss import STAT_FIELDS, TTTModel, fused_chunk_rows
from tests.helpers.drafters import TINY_TRAIN_CFG, tiny_training_drafter

CFG = TINY_TRAIN_CFG
tiny_drafter = tiny_training_drafter


def random_inputs(b: int, t: int, dtype=torch.float32, seed: int = 1, full_mask: bool = False):
    """A batch and a teacher whose rows do not sum to exactly 1 (as bf16 probabilities do not)."""
    gen = torch.Generator().manual_seed(seed)
    h, vd = CFG["hidden_size"], CFG["draft_vocab_size"]
    ids = torch.randint(0, CFG["vocab_size"], (b, t), generator=gen)
    aux = torch.randn(b, t, 3 * h, generator=gen, dtype=torch.float64).to(dtype)
    batch = Batch(ids, torch.ones(b, t, dtype=torch.bool), aux, torch.zeros(b, t, h, dtype=dtype),
                  torch.full((b,), t))
    probs = torch.softmax(2.0 * torch.randn(b, t, vd, generator=gen, dtype=torch.float64), -1)
    probs = probs * (0.97 + 0.06 * torch.rand(b, t, 1, generator=gen, dtype=torch.float64))
    target = torch.randint(-1, vd, (b, t), generator=gen)  # -1: greedy token outside the draft vocab
    keep = torch.ones(b, t, dtype=torch.bool) if full_mask else torch.rand(b, t, generator=gen) < 0.7
    if not full_mask:
        keep[:, :3] = False  # a "prompt"
    return batch, TeacherOut(probs.to(dtype), target, keep)


def with_greedy_targets(model, batch, teacher) -> TeacherOut:
    """Step 0's greedy draft token as the target on every other position, so `correct` is exercised."""
    with torch.no_grad():
        greedy = model.draft_logits(batch.input_ids, batch.aux, steps=1)[0].argmax(-1)  # teacher index t+1
    target = teacher.target.clone()
    target[:, 1::2] = greedy[:, :-1][:, 0::2]
    return TeacherOut(teacher.probs, target, teacher.keep)


def run(model, batch, teacher, fused: bool, chunk_rows: int, ttt_steps: int = 3, scale: float = 1.0):
    model.zero_grad(set_to_none=True)
    ttt = TTTModel(model, ttt_steps, "sdpa", chunk_rows=chunk_rows, fused_loss=fused)
    loss, stats = ttt(batch, teacher)
    (scale * loss).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), stats, grads


def assert_same(ref, got, rtol, atol):
    (l_ref, s_ref, g_ref), (l_got, s_got, g_got) = ref, got
    assert torch.allclose(l_got, l_ref, rtol=rtol, atol=atol), (l_got, l_ref)
    assert s_got.shape == s_ref.shape == (s_ref.shape[0], len(STAT_FIELDS))
    assert torch.allclose(s_got, s_ref.to(s_got.dtype), rtol=rtol, atol=atol), (s_got - s_ref).abs().max()
    assert set(g_got) == set(g_ref) and "lm_head.weight" in g_ref and "fc.weight" in g_ref
    for name in g_ref:
        a, b = g_ref[name], g_got[name]
        assert a.abs().max() > 0, name  # every trainable weight really receives a gradient
        assert torch.allclose(b, a, rtol=rtol, atol=atol * float(a.abs().max())), (name, (a - b).abs().max())


@pytest.mark.parametrize("b,t,chunk,full", [(2, 13, 5, False), (1, 16, 4, True), (1, 9, 1024, False)])
def test_fused_matches_checkpointed_float64(b, t, chunk, full):
    model = tiny_drafter(torch.float64)
    batch, teacher = random_inputs(b, t, torch.float64, full_mask=full)
    teacher = with_greedy_targets(model, batch, teacher)
    ref = run(model, batch, teacher, fused=False, chunk_rows=chunk)
    got = run(model, batch, teacher, fused=True, chunk_rows=chunk)
    assert ref[1][:, 1].sum() > 0 and ref[1][:, 2].sum() > 0  # positions scored, some greedy guesses right
    assert_same(ref, got, rtol=1e-9, atol=1e-11)


def test_fused_matches_checkpointed_float32():
    model = tiny_drafter(torch.float32)
    batch, teacher = random_inputs(2, 12, torch.float32, seed=3)
    teacher = with_greedy_targets(model, batch, teacher)
    ref = run(model, batch, teacher, fused=False, chunk_rows=6)
    got = run(model, batch, teacher, fused=True, chunk_rows=6)
    assert_same(ref, got, rtol=1e-4, atol=1e-5)


def test_backward_scales_with_the_upstream_gradient():
    model = tiny_drafter(torch.float64)
    batch, teacher = random_inputs(2, 10, torch.float64, seed=4)
    unit = run(model, batch, teacher, fused=True, chunk_rows=6)
    scaled = run(model, batch, teacher, fused=True, chunk_rows=6, scale=-2.5)
    for name in ("lm_head.weight", "norm.weight"):  # straight from the fused backward
        assert torch.allclose(scaled[2][name], -2.5 * unit[2][name], rtol=1e-12, atol=0), name
    for name, g in unit[2].items():  # through the layer (its RMSNorms compute in fp32)
        assert torch.allclose(scaled[2][name], -2.5 * g, rtol=1e-5, atol=1e-5 * float(g.abs().max())), name


def test_steps_past_the_record_end_score_nothing():
    """With 5 TTT steps on 4 tokens, steps 3 and 4 have no teacher position: zero stats, no error."""
    model = tiny_drafter(torch.float64)
    batch, teacher = random_inputs(1, 4, torch.float64, full_mask=True)
    ref = run(model, batch, teacher, fused=False, chunk_rows=8, ttt_steps=5)
    got = run(model, batch, teacher, fused=True, chunk_rows=8, ttt_steps=5)
    assert torch.equal(got[1][3:], torch.zeros(2, len(STAT_FIELDS), dtype=got[1].dtype))
    assert_same(ref, got, rtol=1e-9, atol=1e-11)


def test_no_grad_pass_gives_the_same_loss_and_stats():
    model = tiny_drafter(torch.float64)
    batch, teacher = random_inputs(2, 11, torch.float64, seed=5)
    ttt = TTTModel(model, 3, "sdpa", chunk_rows=4)
    loss, stats = ttt(batch, teacher)
    with torch.no_grad():
        loss_eval, stats_eval = ttt(batch, teacher)
    assert loss.requires_grad and not loss_eval.requires_grad
    assert torch.allclose(loss_eval, loss.detach(), rtol=1e-12) and torch.allclose(stats_eval, stats, rtol=1e-12)


def test_second_backward_is_refused():
    model = tiny_drafter()
    batch, teacher = random_inputs(1, 8)
    loss, _ = TTTModel(model, 2, "sdpa")(batch, teacher)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="back-propagated twice"):
        loss.backward()


def test_fused_is_the_default_with_a_budgeted_chunk():
    ttt = TTTModel(tiny_drafter(), 3)
    assert ttt.fused_loss and ttt.chunk_rows == fused_chunk_rows(CFG["draft_vocab_size"])
    assert fused_chunk_rows(32000) == 2048 and fused_chunk_rows(10**9) == 128
    assert TTTModel(tiny_drafter(), 3, fused_loss=False).chunk_rows == 4096


def test_cpu_keeps_fp32_embedding_and_foreach_adamw():
    from engine.train.loop import build_adamw, place_drafter

    model = place_drafter(tiny_drafter(), "cpu")
    assert model.embed_tokens.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.trainable_parameters())
    optim = build_adamw(model.trainable_parameters(), 1e-3)
    assert not optim.defaults.get("fused")


# ------------------------------------------------------------------------------------ CUDA only
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def bf16_cuda_runs(seed: int, b: int, t: int, chunk_rows: int, variants: list[dict]) -> list:
    """(loss, stats, grads) of one bf16-autocast forward/backward per TTTModel variant, same inputs."""
    model = tiny_drafter(torch.float32).cuda()
    batch, teacher = random_inputs(b, t, torch.float32, seed=seed)
    batch = batch.to("cuda", torch.bfloat16)
    teacher = TeacherOut(teacher.probs.to("cuda", torch.bfloat16), teacher.target.cuda(), teacher.keep.cuda())
    results = []
    for variant in variants:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, stats = TTTModel(model, 3, "sdpa", chunk_rows=chunk_rows, **variant)(batch, teacher)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.requires_grad}))
    return results


def assert_bf16_close(results) -> None:
    (l0, s0, g0), (l1, s1, g1) = results
    assert torch.allclose(l0, l1, rtol=1e-3) and torch.allclose(s0, s1, rtol=1e-3, atol=1e-2)
    for name in g0:
        cos = torch.nn.functional.cosine_similarity(g0[name].flatten(), g1[name].flatten(), dim=0)
        assert cos > 0.999, (name, float(cos))


@cuda
def test_cuda_fused_matches_checkpointed_under_bf16_autocast():
    assert_bf16_close(bf16_cuda_runs(7, 2, 64, 32, [{"fused_loss": False}, {"fused_loss": True}]))


@cuda
def test_cuda_bf16_embedding_and_fused_adamw_resume():
    from engine.train.loop import build_adamw, place_drafter

    model = place_drafter(tiny_drafter(), "cuda")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.trainable_parameters())
    optim = build_adamw(model.trainable_parameters(), 1e-3)
    assert optim.defaults["fused"]
    batch, teacher = random_inputs(1, 32, seed=9)
    batch = batch.to("cuda", torch.bfloat16)
    teacher = TeacherOut(teacher.probs.to("cuda", torch.bfloat16), teacher.target.cuda(), teacher.keep.cuda())

    def step(m, o):
        o.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = TTTModel(m, 2, "sdpa")(batch, teacher)
        loss.backward()
        o.step()

    step(model, optim)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, buffer)
    twin = place_drafter(tiny_drafter(), "cuda")
    state = torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=False)
    twin.load_state_dict(state["model"])
    twin_optim = build_adamw(twin.trainable_parameters(), 1e-3)
    twin_optim.load_state_dict(state["optim"])
    step(model, optim)
    step(twin, twin_optim)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name


def test_compiled_chunk_pass_traces_to_the_same_result(monkeypatch):
    """compile_head=True: the chunk pass goes through dynamo (aot_eager here: inductor's CPU build takes
    longer than this file may; the CUDA test below uses the real backend)."""
    from engine.train import loss as loss_mod

    compiled = torch.compile(loss_mod._chunk_logits_pass, dynamic=True, backend="aot_eager")
    monkeypatch.setattr(loss_mod, "_COMPILED_CHUNK_PASS", compiled)
    assert_compiled_head_matches_eager(seed=11, rtol=1e-9, atol=1e-11)


def assert_compiled_head_matches_eager(seed: int, rtol: float, atol: float) -> None:
    """compile_head=True gives the eager fused path's loss, stats and gradients (float64, CPU)."""
    model = tiny_drafter(torch.float64)
    batch, teacher = random_inputs(2, 13, torch.float64, seed=seed)
    teacher = with_greedy_targets(model, batch, teacher)
    ref = run(model, batch, teacher, fused=True, chunk_rows=5)
    model.zero_grad(set_to_none=True)
    loss, stats = TTTModel(model, 3, "sdpa", chunk_rows=5, compile_head=True)(batch, teacher)
    loss.backward()
    got = (loss.detach(), stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert_same(ref, got, rtol=rtol, atol=atol)


@cuda
def test_cuda_compiled_head_matches_eager_fused():
    assert_bf16_close(bf16_cuda_runs(13, 1, 96, 40, [{"compile_head": False}, {"compile_head": True}]))


def test_a_broken_compiler_falls_back_to_the_eager_head(monkeypatch, capsys):
    """A machine whose torch.compile cannot build kernels (simulated: the compiled function raises, as
    inductor does without a C compiler) still trains, with the eager function and the same result."""
    from engine.train import loss as loss_mod
    from engine.train import mixed

    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("InductorError: no working C compiler found")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(mixed, "_BROKEN", [])
    monkeypatch.setattr(loss_mod, "_COMPILED_CHUNK_PASS", mixed.compiled_or_eager(loss_mod._chunk_logits_pass,
                                                                                  anywhere=True))
    assert_compiled_head_matches_eager(seed=12, rtol=1e-12, atol=1e-14)
    assert "compiled _chunk_logits_pass unavailable (RuntimeError: InductorError" in capsys.readouterr().err
    assert len(mixed._BROKEN) == 1  # reported once, then eager without retrying


def test_compiled_head_is_on_by_default_on_cuda_only(monkeypatch):
    from engine.train.loop import compile_head_wanted

    monkeypatch.delenv("EAGLE3_TRAIN_COMPILE_HEAD", raising=False)
    assert compile_head_wanted(True) and not compile_head_wanted(False)
    monkeypatch.setenv("EAGLE3_TRAIN_COMPILE_HEAD", "0")
    assert not compile_head_wanted(True)
    monkeypatch.setenv("EAGLE3_TRAIN_COMPILE_HEAD", "1")
    assert compile_head_wanted(False)
