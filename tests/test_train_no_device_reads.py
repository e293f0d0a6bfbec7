"""The training step's forward and backward never wait for the GPU: every read of device data makes the
host wait until the GPU has drained its queue, and the GPU then idles while the host queues the next
kernels. The step runs here on the meta device (shapes, no data), where any such read raises; the only
data it needs from the batch, which rows the loss scores, comes from the teacher's host copy."""

from __future__ import annotations

import pytest
import torch

from engine.train.data import Batch, TeacherOut
from engine.train.loss import TTTModel, _chunk_len, row_chunks
from tests.helpers.drafters import tiny_training_drafter


def _record(b: int, t: int, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    batch = Batch(torch.randint(0, 90, (b, t), generator=gen), torch.ones(b, t, dtype=torch.bool),
                  torch.randn(b, t, 96, generator=gen), torch.zeros(b, t, 32), torch.full((b,), t))
    probs = torch.softmax(torch.randn(b, t, 40, generator=gen), -1)
    keep = torch.rand(b, t, generator=gen) < 0.7
    keep[:, :3] = False  # a prompt
    return batch, TeacherOut(probs, torch.randint(-1, 40, (b, t), generator=gen), keep)


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
def test_a_training_step_reads_no_device_data(backend, monkeypatch):
    from engine.train import merged_attention

    # The fused kernel's probe reads its results once per process (cached), not in the step: here it
    # probes on the CPU what the meta step will use.
    probed = merged_attention.probed_kernel
    monkeypatch.setattr(merged_attention, "probed_kernel", lambda name, device, *rest: probed(name, "cpu", *rest))
    model = tiny_training_drafter().to("meta")
    batch, teacher = _record(2, 20)
    meta = lambda t: t.to("meta")  # noqa: E731
    on_meta = TeacherOut(meta(teacher.probs), meta(teacher.target), meta(teacher.keep), keep_host=teacher.keep)
    loss, stats = TTTModel(model, 7, backend)(Batch(*(meta(x) for x in batch.tensors())), on_meta)
    loss.backward()
    assert stats.shape == (7, 6) and loss.device.type == "meta"
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.shape == p.shape
                         for (name, g), p in zip(grads.items(), [p for p in model.parameters() if p.requires_grad]))


def test_without_the_host_copy_the_step_must_read_the_mask_from_the_device():
    """The meta check above can fail: the same step without keep_host reads `keep` and raises there."""
    model = tiny_training_drafter().to("meta")
    batch, teacher = _record(2, 20)
    meta = lambda t: t.to("meta")  # noqa: E731
    with pytest.raises(NotImplementedError, match="meta"):
        TTTModel(model, 7, "sdpa")(Batch(*(meta(x) for x in batch.tensors())),
                                   TeacherOut(meta(teacher.probs), meta(teacher.target), meta(teacher.keep)))


def _rows(step_chunks) -> torch.Tensor:
    parts = [torch.arange(c.start, c.stop) if isinstance(c, slice) else c for c in step_chunks]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


@pytest.mark.parametrize("b,t,steps,chunk_rows", [(2, 20, 7, 4), (1, 5, 7, 128), (3, 9, 2, 5), (2, 30, 7, 1000)])
def test_row_chunks_are_each_steps_accuracy_mask_rows(b, t, steps, chunk_rows):
    _, teacher = _record(b, t, seed=b * 100 + t)
    for given in (teacher, TeacherOut(teacher.probs, teacher.target, teacher.keep, keep_host=teacher.keep.clone())):
        chunks = row_chunks(given, steps, torch.device("cpu"), chunk_rows)
        assert len(chunks) == min(steps, t - 1)  # steps past the record's end score nothing
        for k, step in enumerate(chunks):
            want = teacher.keep[:, k + 1:].reshape(-1).nonzero().squeeze(1)
            assert torch.equal(_rows(step), want), k
            assert all(0 < _chunk_len(c) <= chunk_rows for c in step)
            # Indices only where the rows have a gap; a run without one is a slice (a view, no gather).
            assert all(int(c[-1]) - int(c[0]) + 1 > c.numel() for c in step if not isinstance(c, slice))


def test_a_mask_without_gaps_is_read_in_slices_and_trains_the_same_as_gathered_rows(monkeypatch):
    """A prompt and the record's end masked: each step's rows run without a gap, so the loss reads views
    (nothing gathered); the same rows forced through index_select give the same loss and gradients."""
    from engine.train import loss as loss_mod

    batch, teacher = _record(1, 24)
    keep = torch.ones_like(teacher.keep)
    keep[:, :4] = False
    keep[:, -1] = False
    teacher = TeacherOut(teacher.probs, teacher.target, keep)
    chunks = row_chunks(teacher, 7, torch.device("cpu"), 8)
    assert chunks and all(isinstance(c, slice) for step in chunks for c in step)

    def run():
        torch.manual_seed(0)
        model = tiny_training_drafter()
        loss, stats = TTTModel(model, 7, "sdpa", chunk_rows=8)(batch, teacher)
        loss.backward()
        return loss.detach(), stats, [p.grad.clone() for p in model.parameters() if p.requires_grad]

    sliced = run()
    as_indices = lambda *args: [tuple(torch.arange(c.start, c.stop) for c in step)  # noqa: E731
                                for step in row_chunks(*args)]
    monkeypatch.setattr(loss_mod, "row_chunks", as_indices)
    gathered = run()
    assert torch.equal(sliced[0], gathered[0]) and torch.equal(sliced[1], gathered[1])
    assert len(sliced[2]) == len(gathered[2]) > 0
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(sliced[2], gathered[2]))
