"""The training step's forward and backward never wait for the GPU: every read of device data makes the
host wait until the GPU has drained its queue, and the GPU then idles while the host queues the next
kernels. The step runs here on the meta device (shapes, no data), where any such read raises; the only
data it needs from the batch, which rows the loss scores, comes from the teacher's host copy."""

from __future__ import annotations

import pytest
import torch

from engine.train.data import Batch, TeacherOut
from engine.train.loss import TTTModel, kept_rows
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


@pytest.mark.parametrize("b,t,steps", [(2, 20, 7), (1, 5, 7), (3, 9, 2)])
def test_kept_rows_are_each_steps_accuracy_mask_rows(b, t, steps):
    _, teacher = _record(b, t, seed=b * 100 + t)
    for given in (teacher, TeacherOut(teacher.probs, teacher.target, teacher.keep, keep_host=teacher.keep.clone())):
        kept = kept_rows(given, steps, torch.device("cpu"))
        assert len(kept) == min(steps, t - 1)  # steps past the record's end score nothing
        for k, rows in enumerate(kept):
            want = teacher.keep[:, k + 1:].reshape(-1).nonzero().squeeze(1)
            assert torch.equal(rows, want), k
