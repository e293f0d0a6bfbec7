"""Mixed precision of the training step (engine.train.mixed): under bf16 autocast each weight is cast once
per step and its gradient summed once, in fp32, however many TTT steps use it; RMSNorm returns the compute
dtype with its own backward. Checked on the CPU (CPU autocast, bf16) against the previous path (plain
autocast, EAGLE3_TRAIN_PLAIN_AUTOCAST=1) and against an fp32 run without autocast."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.train import mixed
from engine.train.data import Batch, TeacherOut
from engine.train.loss import TTTModel
from tests.helpers.drafters import TINY_TRAIN_CFG, tiny_drafter
from tests.helpers.drafters import ttt_inputs as inputs

CFG = TINY_TRAIN_CFG
TTT = 7


def step(model, autocast: bool, plain: bool, monkeypatch, log: TorchDispatchMode | None = None,
         compile_head: bool = False):
    """Loss and fp32 gradients of one TTT step (fused head, sdpa attention)."""
    monkeypatch.setenv("EAGLE3_TRAIN_PLAIN_AUTOCAST", "1" if plain else "0")
    model.zero_grad(set_to_none=True)
    batch, teacher = inputs()
    if not autocast:
        batch = Batch(batch.input_ids, batch.loss_mask, batch.aux.float(), batch.hidden.float(), batch.lengths)
        teacher = TeacherOut(teacher.probs.float(), teacher.target, teacher.keep)
    ttt = TTTModel(model, TTT, "sdpa", compile_head=compile_head)
    with log or contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = ttt(batch, teacher)
        loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


class WeightOps(TorchDispatchMode):
    """Counts, per weight shape, the casts to bf16 and the bf16 adds that run on weight-shaped tensors."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = {tuple(s) for s in shapes}
        self.casts: collections.Counter = collections.Counter()
        self.bf16_adds: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None and tuple(first.shape) in self.shapes:
            name = str(func)
            if "_to_copy" in name and first.dtype == torch.float32 and out.dtype == torch.bfloat16:
                self.casts[tuple(first.shape)] += 1
            source = args[1] if name.startswith("aten.copy_") and len(args) > 1 else None
            if isinstance(source, torch.Tensor) and source.dtype == torch.float32 and first.dtype == torch.bfloat16:
                self.casts[tuple(first.shape)] += 1  # cast into its rows of a stacked copy (stacked_linears)
            if name.startswith("aten.add") and first.dtype == torch.bfloat16:
                self.bf16_adds[tuple(first.shape)] += 1
        return out


def projection_shapes(model) -> list[tuple[int, ...]]:
    return [tuple(m.weight.shape) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name != "lm_head"]


def test_each_weight_is_cast_once_and_its_gradient_summed_without_bf16_adds(monkeypatch):
    model = tiny_drafter()
    shapes = projection_shapes(model)
    log = WeightOps(shapes)
    step(model, True, False, monkeypatch, log)
    by_shape = collections.Counter(shapes)  # k_proj and v_proj share a shape, as gate_proj and up_proj
    assert log.casts == by_shape, log.casts  # one cast per weight and step, not one per TTT step
    assert not log.bf16_adds, log.bf16_adds  # the 7 TTT steps' weight gradients never meet in bf16

    previous = WeightOps(shapes)
    step(model, True, True, monkeypatch, previous)  # plain autocast: the cached cast, gradients summed in bf16
    assert previous.casts == by_shape
    assert sum(previous.bf16_adds.values()) == (TTT - 1) * (len(shapes) - 1)  # every projection but fc


@pytest.mark.parametrize("seed", [0, 2])
def test_loss_and_gradients_match_the_previous_path_and_sit_closer_to_fp32(monkeypatch, seed):
    """bf16 at these tiny shapes (weights of std 0.3, seven recurrent steps) leaves 4-25 % relative error in
    the gradients of either path against fp32; the new path's is at most the previous one's (summed over
    the weights, and within 20 % of it for each weight)."""
    model = tiny_drafter(seed)
    loss_ref, ref = step(model, False, True, monkeypatch)  # fp32 throughout, plain autograd (no autocast)
    loss_new, new = step(model, True, False, monkeypatch)
    loss_old, old = step(model, True, True, monkeypatch)
    assert abs(loss_new - loss_old) < 2e-3 * abs(loss_old), (loss_new, loss_old)
    assert abs(loss_new - loss_ref) < 2e-3 * abs(loss_ref), (loss_new, loss_ref)
    err_new = err_old = 0.0
    for name, g in ref.items():
        assert new[name].dtype == torch.float32 and new[name].shape == g.shape
        assert float(g.abs().max()) > 0, name  # every trainable weight really receives a gradient
        e_new, e_old = float((new[name] - g).norm() / g.norm()), float((old[name] - g).norm() / g.norm())
        assert e_new < 1.2 * e_old + 1e-3, (name, e_new, e_old)
        err_new, err_old = err_new + e_new, err_old + e_old
    assert err_new < 0.8 * err_old, (err_new, err_old)  # fp32 accumulation, one rounding per norm


class InputGradAdds(TorchDispatchMode):
    """Counts the bf16 adds on tensors of one activation shape (the attention's [B, T, 2H] input)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.adds = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (first is not None and str(func).startswith("aten.add") and tuple(first.shape) == self.shape
                and first.dtype == torch.bfloat16):
            self.adds += 1
        return func(*args, **(kwargs or {}))


def test_stacked_projections_give_the_separate_ones_result_with_one_input_gradient_gemm(monkeypatch):
    """q/k/v (and gate/up) as one GEMM over stacked weights: the same loss and gradients as the separate
    projections, and the attention input's gradient no longer sums three bf16 products per TTT step."""
    t = inputs()[0].input_ids.shape[1]
    attention_input = (1, t, 2 * CFG["hidden_size"])
    runs = {}
    for separate in (True, False):
        monkeypatch.setenv("EAGLE3_TRAIN_SEPARATE_PROJECTIONS", "1" if separate else "0")
        log = InputGradAdds(attention_input)
        runs[separate] = (*step(tiny_drafter(), True, False, monkeypatch, log), log.adds)
    (loss_sep, grads_sep, adds_sep), (loss_stk, grads_stk, adds_stk) = runs[True], runs[False]
    assert adds_sep == 2 * TTT and adds_stk == 0, (adds_sep, adds_stk)
    assert abs(loss_stk - loss_sep) < 1e-3 * abs(loss_sep), (loss_stk, loss_sep)
    for name, g in grads_sep.items():
        assert grads_stk[name].dtype == torch.float32 and grads_stk[name].shape == g.shape, name
        assert float((grads_stk[name] - g).norm() / g.norm()) < 0.05, name  # bf16 roundings differ, no more


def test_stacked_projections_leave_each_weight_its_own_fp32_gradient(monkeypatch):
    monkeypatch.setenv("EAGLE3_TRAIN_SEPARATE_PROJECTIONS", "0")
    model = tiny_drafter()
    step(model, True, False, monkeypatch)
    attn, mlp = model.midlayer.self_attn, model.midlayer.mlp
    for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        assert m.weight.grad is not None and m.weight.grad.shape == m.weight.shape and m.weight.grad.is_contiguous()
        assert m.weight.grad.dtype == torch.float32 and float(m.weight.grad.abs().max()) > 0
        assert m._stack is None and m._cast is None  # nothing held between steps


def test_rms_norm_backward_is_the_exact_derivative():
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.empty(16, dtype=torch.float64).uniform_(0.5, 1.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: mixed.rms_norm(a, b, 1e-5), (x, w))
    ref = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(mixed.rms_norm(x, w, 1e-5), ref)


def test_swiglu_backward_is_the_exact_derivative_of_silu_gate_times_up():
    gate_up = torch.randn(3, 5, 2 * 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(mixed.swiglu, (gate_up,))
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(mixed.swiglu(gate_up), torch.nn.functional.silu(gate) * up)


def test_swiglu_keeps_only_its_stacked_input_for_backward():
    """Eager silu(gate) * up also saves silu(gate), a [T, intermediate] tensor per TTT step."""
    saved = []
    gate_up = torch.randn(4, 2 * 12, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = mixed.swiglu(gate_up * 1)
    assert [tuple(t.shape) for t in saved] == [(4, 24)]
    out.float().sum().backward()
    assert gate_up.grad.shape == gate_up.shape and gate_up.grad.dtype == torch.bfloat16


def test_rms_norm_returns_the_compute_dtype_under_autocast_only():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.ones(16)
    assert mixed.rms_norm(x, w, 1e-5).dtype == torch.float32  # promoted, as the layers after it expect
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mixed.rms_norm(x.float(), w, 1e-5).dtype == torch.bfloat16


def test_outside_a_training_forward_the_linears_are_plain(monkeypatch):
    model = tiny_drafter()
    batch, _ = inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with mixed.step_weights(model):
            assert all(m._cast_dtype is None for m in model.modules() if isinstance(m, mixed.CastLinear))
        logits = model.draft_logits(batch.input_ids, batch.aux, steps=2)
    assert all(torch.isfinite(x).all() for x in logits)
    step(model, True, False, monkeypatch)
    assert all(m._cast is None and m._cast_dtype is None for m in model.modules() if isinstance(m, mixed.CastLinear))


def test_compiled_kernels_trace_to_the_eager_result(monkeypatch):
    """The CUDA path compiles the norm's two kernels, the RoPE and the head's norm kernels; here dynamo traces
    them (aot_eager: inductor's CPU build takes longer than this file may) and must give the eager values and
    gradients (the head's softmax pass stays eager here: test_train_fused traces it)."""
    from engine.train import loss as loss_mod
    from engine.train import model as model_mod

    calls = []
    real_compile = torch.compile

    def aot_eager(fn, **kwargs):
        calls.append(fn.__name__)
        return real_compile(fn, dynamic=True, backend="aot_eager")

    monkeypatch.setattr(mixed, "_BROKEN", [])
    monkeypatch.setattr(mixed, "COMPILE_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(torch, "compile", aot_eager)
    monkeypatch.setattr(mixed, "_rms_forward_kernel", mixed.compiled_or_eager(mixed._rms_forward))
    monkeypatch.setattr(mixed, "_rms_backward_kernel", mixed.compiled_or_eager(mixed._rms_backward))
    monkeypatch.setattr(mixed, "_swiglu_forward_kernel", mixed.compiled_or_eager(mixed._swiglu_forward))
    monkeypatch.setattr(mixed, "_swiglu_backward_kernel", mixed.compiled_or_eager(mixed._swiglu_backward))
    monkeypatch.setattr(model_mod, "rope_qk", mixed.compiled_or_eager(model_mod._rope_qk))
    monkeypatch.setattr(loss_mod, "_COMPILED_HEAD_NORM", (mixed.compiled_or_eager(loss_mod._head_norm_forward),
                                                          mixed.compiled_or_eager(loss_mod._head_norm_backward)))
    monkeypatch.setattr(loss_mod, "_COMPILED_CHUNK_PASS", loss_mod._chunk_logits_pass)
    model = tiny_drafter()
    got_loss, got = step(model, True, False, monkeypatch, compile_head=True)
    assert sorted(set(calls)) == ["_head_norm_backward", "_head_norm_forward", "_rms_backward", "_rms_forward",
                                  "_rope_qk", "_swiglu_backward", "_swiglu_forward"] and not mixed._BROKEN
    monkeypatch.setattr(mixed, "COMPILE_DEVICES", ())
    ref_loss, ref = step(model, True, False, monkeypatch)
    assert got_loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in ref.items():
        assert torch.allclose(got[name], g, rtol=1e-3, atol=1e-3 * float(g.abs().max())), name


def test_a_broken_compiler_falls_back_to_eager_kernels(monkeypatch, capsys):
    """Where torch.compile cannot build kernels (simulated: the compiled function raises, as inductor does
    without a C compiler) the step still runs, eagerly, with the same result, and says so once."""
    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no working C compiler (simulated)")
        return call

    model = tiny_drafter()
    ref_loss, ref = step(model, True, False, monkeypatch)
    monkeypatch.setattr(mixed, "COMPILE_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(mixed, "_BROKEN", [])
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(mixed, "_rms_forward_kernel", mixed.compiled_or_eager(mixed._rms_forward))
    got_loss, got = step(model, True, False, monkeypatch)
    assert mixed._BROKEN and "simulated" in mixed._BROKEN[0]
    assert capsys.readouterr().err.count("training continues eagerly") == 1
    assert got_loss == ref_loss and all(torch.equal(got[n], ref[n]) for n in ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_weight_gradients_accumulate_in_one_fp32_gemm_per_use():
    torch.manual_seed(0)
    lin = mixed.CastLinear(64, 48, bias=False).cuda()
    x = torch.randn(TTT, 96, 64, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16), mixed.step_weights(lin):
        sum(lin(x[k]).float().sum() for k in range(TTT)).backward()
    exact = torch.ones(TTT * 96, 48, device="cuda", dtype=torch.float64).T @ x.reshape(-1, 64).double()
    assert not mixed.FP32_GEMM_BROKEN, mixed.FP32_GEMM_BROKEN
    assert lin.weight.grad.dtype == torch.float32
    assert float((lin.weight.grad.double() - exact).abs().max()) < 1e-4 * float(exact.abs().max())


def test_compiled_kernels_keep_the_model_widths_constant_unless_all_dynamic_is_asked(monkeypatch):
    """dynamic=True made every width symbolic, so the kernels divided each element's index by a runtime
    width; automatic dynamic shapes (None) make only the dimensions that change between calls symbolic."""
    seen = []

    def record(fn, **kwargs):
        seen.append(kwargs.get("dynamic", "unset"))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    monkeypatch.setattr(mixed, "_BROKEN", [])
    monkeypatch.setattr(mixed, "COMPILE_DEVICES", ("cpu",))
    monkeypatch.delenv("EAGLE3_TRAIN_PLAIN_AUTOCAST", raising=False)
    kernel = mixed.compiled_or_eager(mixed._swiglu_forward)
    x = torch.randn(3, 8)
    monkeypatch.delenv("EAGLE3_TRAIN_COMPILE_DYNAMIC", raising=False)
    kernel(x)
    kernel(x)
    monkeypatch.setenv("EAGLE3_TRAIN_COMPILE_DYNAMIC", "all")
    kernel(x)
    assert seen == [None, True]  # one compile per mode, kept for later calls
