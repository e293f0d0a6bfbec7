"""The fused-kernel TTT attention (engine.train.merged_attention) against the dense-mask reference.

The reference is one SDPA over all keys with an explicit [T, S*T] mask: a different computation, so
agreement in float64 (to rounding) says the log-space merge and the merged-LSE backward are exact.
"""

from __future__ import annotations

import pytest
import torch

from engine.train.attention import ttt_attention


def _inputs(batch, kv, groups, t, d, steps, dtype, device="cpu", seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_()

    q = rnd(batch, kv * groups, t, d)
    keys = [rnd(batch, kv, t, d) for _ in range(steps)]
    values = [rnd(batch, kv, t, d) for _ in range(steps)]
    return q, keys, values


def _value_and_grads(backend, q, keys, values, weight):
    out = ttt_attention(q, keys, values, backend)
    grads = torch.autograd.grad((out.double() * weight).sum(), [q, *keys, *values])
    return out, grads


def _assert_flash_equals_dense_in_float64(q, keys, values, backend="flash"):
    weight = torch.randn(q.shape, dtype=torch.float64)
    out, grads = _value_and_grads(backend, q, keys, values, weight)
    ref_out, ref_grads = _value_and_grads("dense", q, keys, values, weight)
    assert out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    steps = len(keys)
    for name, got, want in zip(["q"] + [f"k{i}" for i in range(steps)] + [f"v{i}" for i in range(steps)],
                               grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("groups,steps", [(1, 1), (1, 4), (4, 1), (2, 3), (4, 7)])
def test_flash_backend_equals_the_dense_reference_in_float64(groups, steps):
    _assert_flash_equals_dense_in_float64(*_inputs(2, 2, groups, 37, 16, steps, torch.float64))


def test_a_wrong_diagonal_is_caught():
    """The comparison above can fail: a diagonal key moved by one position changes the output."""
    q, keys, values = _inputs(1, 2, 2, 19, 8, 3, torch.float64)
    shifted = [keys[0], keys[1].roll(1, dims=2), keys[2]]
    assert not torch.allclose(ttt_attention(q, shifted, values, "flash"), ttt_attention(q, keys, values, "dense"))


def test_flash_backend_in_float32_matches_the_memory_linear_sdpa_backend():
    q, keys, values = _inputs(1, 2, 2, 64, 32, 4, torch.float32, seed=3)
    weight = torch.randn(q.shape, dtype=torch.float64)
    out, grads = _value_and_grads("flash", q, keys, values, weight)
    ref_out, ref_grads = _value_and_grads("sdpa", q, keys, values, weight)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("groups,steps,t", [(4, 1, 256), (4, 7, 1000), (1, 3, 512)])
def test_cuda_kernel_in_bf16_matches_the_float64_reference(groups, steps, t, backend, capsys):
    from engine.train.merged_attention import usable_kernel

    q, keys, values = _inputs(1, 8 // groups, groups, t, 128, steps, torch.bfloat16, device="cuda", seed=5)
    kernel = usable_kernel(q, backend)
    if kernel is None or kernel.name != backend:  # this build lacks it: the run falls back, and says why
        pytest.skip(f"{backend} kernel unusable here: {capsys.readouterr().err.strip()}")
    weight = torch.randn(q.shape, dtype=torch.float64, device="cuda")
    out, grads = _value_and_grads(backend, q, keys, values, weight)
    as64 = [x.detach().double().requires_grad_() for x in (q, *keys, *values)]
    ref_out, ref_grads = _value_and_grads("dense", as64[0], as64[1:1 + steps], as64[1 + steps:], weight)
    # bf16 inputs, fp32 accumulation: compare as relative errors against the float64 truth
    assert ((out.double() - ref_out).norm() / ref_out.norm()).item() < 1e-2
    for got, want in zip(grads, ref_grads):
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2


def test_a_training_step_with_the_flash_backend_equals_the_sdpa_backend(monkeypatch):
    """Through the drafter: same loss and gradients as the memory-linear backend (float32 on the CPU)."""
    from engine.train.data import Batch, TeacherOut
    from engine.train.loss import TTTModel
    from tests.helpers.drafters import tiny_drafter, ttt_inputs as inputs

    TTT = 7

    monkeypatch.setenv("EAGLE3_TRAIN_PLAIN_AUTOCAST", "0")
    results = []
    for backend in ("flash", "sdpa"):
        model = tiny_drafter()
        batch, teacher = inputs()
        batch = Batch(batch.input_ids, batch.loss_mask, batch.aux.float(), batch.hidden.float(), batch.lengths)
        teacher = TeacherOut(teacher.probs.float(), teacher.target, teacher.keep)
        loss, _ = TTTModel(model, TTT, backend)(batch, teacher)
        loss.backward()
        results.append((float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (loss, grads), (ref_loss, ref_grads) = results
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()), msg=name)


def test_the_compiled_merge_traces_to_the_eager_result(monkeypatch):
    """On CUDA the merge and the diagonal backward are compiled: dynamo (aot_eager here) must agree."""
    from engine.train import merged_attention, mixed

    real_compile = torch.compile
    monkeypatch.setattr(mixed, "_BROKEN", [])
    monkeypatch.setattr(mixed, "COMPILE_DEVICES", ("cpu",))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, dynamic=True, backend="aot_eager"))
    monkeypatch.setattr(merged_attention, "merge_forward", mixed.compiled_or_eager(merged_attention._merge_forward))
    monkeypatch.setattr(merged_attention, "diag_backward", mixed.compiled_or_eager(merged_attention._diag_backward))
    q, keys, values = _inputs(1, 2, 2, 29, 16, 3, torch.float32, seed=7)
    weight = torch.randn(q.shape, dtype=torch.float64)
    out, grads = _value_and_grads("flash", q, keys, values, weight)
    assert not mixed._BROKEN
    monkeypatch.setattr(mixed, "COMPILE_DEVICES", ())
    ref_out, ref_grads = _value_and_grads("flash", q, keys, values, weight)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_device_without_the_fused_kernel_falls_back_to_the_exact_sdpa_path(monkeypatch, capsys):
    from engine.train import merged_attention

    def no_kernel(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.")

    broken = merged_attention.CausalKernel("cpu", no_kernel, no_kernel)
    monkeypatch.setitem(merged_attention.KERNELS, "cpu", broken)
    merged_attention.probed_kernel.cache_clear()
    try:
        q, keys, values = _inputs(1, 2, 2, 23, 8, 3, torch.float64)
        out = ttt_attention(q, keys, values, "flash")
    finally:
        merged_attention.probed_kernel.cache_clear()
    torch.testing.assert_close(out, ttt_attention(q, keys, values, "dense"), rtol=1e-5, atol=1e-6)  # sdpa merges in fp32
    assert "cpu attention unavailable on cpu for 8-wide torch.float64 heads (No available kernel" in capsys.readouterr().err


def test_a_cudnn_kernel_that_fails_its_probe_gives_way_to_flash_not_to_sdpa(monkeypatch, capsys):
    """The default backend's kernel turned down (an old cuDNN, say): FlashAttention-2 runs, and a note says so."""
    from dataclasses import replace

    from engine.train import merged_attention

    def no_kernel(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: no valid execution plan")

    cpu = merged_attention.KERNELS["cpu"]
    monkeypatch.setitem(merged_attention.KERNELS, "cudnn", merged_attention.CausalKernel("cudnn", no_kernel, no_kernel))
    monkeypatch.setitem(merged_attention.KERNELS, "flash", replace(cpu, name="flash"))
    monkeypatch.setattr(merged_attention, "kernel_for", lambda device, preferred="flash": merged_attention.KERNELS[preferred])
    merged_attention.probed_kernel.cache_clear()
    try:
        q, keys, values = _inputs(1, 2, 2, 23, 8, 3, torch.float64)
        assert merged_attention.usable_kernel(q, "cudnn").name == "flash"
        _assert_flash_equals_dense_in_float64(q, keys, values, backend="cudnn")
    finally:
        merged_attention.probed_kernel.cache_clear()
    assert ("note: cudnn attention unavailable on cpu for 8-wide torch.float64 heads (cuDNN Frontend error: "
            "no valid execution plan); training uses flash") in capsys.readouterr().err


def test_kernels_without_native_gqa_get_repeated_keys_and_summed_gradients(monkeypatch):
    from engine.train import merged_attention

    cpu = merged_attention.KERNELS["cpu"]

    def equal_heads_only(entry):
        def call(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
            if len({t.shape[1] for t in tensors}) > 1:
                raise RuntimeError("number of heads in key/value must equal the query's")
            return entry(*args, **kwargs)
        return call

    monkeypatch.setitem(merged_attention.KERNELS, "cpu", merged_attention.CausalKernel(
        "cpu", equal_heads_only(cpu.forward), equal_heads_only(cpu.backward)))
    merged_attention.probed_kernel.cache_clear()
    try:
        q = torch.randn(1, 4, 8, 8, dtype=torch.float64)
        assert merged_attention.usable_kernel(q).native_gqa is False
        _assert_flash_equals_dense_in_float64(*_inputs(1, 2, 2, 19, 8, 3, torch.float64, seed=11))
    finally:
        merged_attention.probed_kernel.cache_clear()


def _cpu_kernel_variant(monkeypatch, forward=None, backward=None):
    from engine.train import merged_attention

    cpu = merged_attention.KERNELS["cpu"]
    monkeypatch.setitem(merged_attention.KERNELS, "cpu", merged_attention.CausalKernel(
        "cpu", forward or cpu.forward, backward or cpu.backward))
    merged_attention.probed_kernel.cache_clear()
    return cpu


def test_a_kernel_that_reads_grouped_heads_wrongly_gets_repeated_heads(monkeypatch):
    """No error, right shapes, wrong values: the probe compares values, so grouped heads are repeated."""
    from engine.train import merged_attention

    def tiled(x, groups):  # [k0, k1, k0, k1] where the query groups need [k0, k0, k1, k1]
        return x.repeat(1, groups, 1, 1)

    def forward(q, k, v, scale):
        g = q.shape[1] // k.shape[1]
        return cpu.forward(q, tiled(k, g), tiled(v, g), scale)

    def backward(dout, q, k, v, out, lse, state, scale):
        g = q.shape[1] // k.shape[1]
        dq, dk, dv = cpu.backward(dout, q, tiled(k, g), tiled(v, g), out, lse, state, scale)
        return dq, dk.unflatten(1, (g, -1)).sum(1), dv.unflatten(1, (g, -1)).sum(1)

    cpu = _cpu_kernel_variant(monkeypatch, forward, backward)
    try:
        assert merged_attention.usable_kernel(torch.randn(1, 4, 8, 8, dtype=torch.float64)).native_gqa is False
        _assert_flash_equals_dense_in_float64(*_inputs(1, 2, 2, 19, 8, 3, torch.float64, seed=4))
    finally:
        merged_attention.probed_kernel.cache_clear()


def test_a_kernel_not_to_probe_with_grouped_heads_never_sees_them(monkeypatch):
    """cuDNN's kernel is never handed fewer key/value heads (a read past them could fault the device)."""
    from dataclasses import replace

    from engine.train import merged_attention

    def equal_heads(entry):
        def call(*args, **kwargs):
            heads = {a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4}
            assert len(heads) == 1, f"grouped heads reached the kernel: {heads}"
            return entry(*args, **kwargs)
        return call

    cpu = merged_attention.KERNELS["cpu"]
    monkeypatch.setitem(merged_attention.KERNELS, "cpu", replace(
        cpu, forward=equal_heads(cpu.forward), backward=equal_heads(cpu.backward), probe_grouped=False))
    merged_attention.probed_kernel.cache_clear()
    try:
        assert merged_attention.usable_kernel(torch.randn(1, 4, 8, 8, dtype=torch.float64)).native_gqa is False
        _assert_flash_equals_dense_in_float64(*_inputs(1, 2, 2, 19, 8, 3, torch.float64, seed=6))
    finally:
        merged_attention.probed_kernel.cache_clear()
    assert merged_attention.KERNELS["cudnn"].probe_grouped is False


def test_a_kernel_whose_log_sum_exp_is_in_another_base_is_not_used(monkeypatch, capsys):
    from engine.train import merged_attention

    def forward(q, k, v, scale):
        out, lse, state = cpu.forward(q, k, v, scale)
        return out, lse / torch.log(torch.tensor(2.0, dtype=lse.dtype)), state

    cpu = _cpu_kernel_variant(monkeypatch, forward)
    try:
        q, keys, values = _inputs(1, 2, 2, 23, 8, 3, torch.float64)
        out = ttt_attention(q, keys, values, "flash")
    finally:
        merged_attention.probed_kernel.cache_clear()
    torch.testing.assert_close(out, ttt_attention(q, keys, values, "dense"), rtol=1e-5, atol=1e-6)  # the sdpa path
    assert "cpu attention unavailable on cpu for 8-wide torch.float64 heads (its log-sum-exp disagrees" in capsys.readouterr().err


def test_the_probe_finds_the_cpu_kernels_native_gqa_at_the_real_head_width():
    from engine.train import merged_attention

    kernel = merged_attention.usable_kernel(torch.randn(1, 4, 8, 24, dtype=torch.float32))
    assert kernel is not None and kernel.name == "cpu" and kernel.native_gqa is True
