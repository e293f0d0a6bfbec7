"""fp8 storage of the aux states (engine.aux_fp8, `extract.aux_format = "fp8"`): real records read by
safetensors' own readers, the error of the round trip bounded, every check of a bf16 record kept."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open

from engine.records import (
    RecordError,
    load_record,
    quantize_sources,
    record_size,
    verify_record,
    write_record,
    write_record_stream,
)
from engine.capture.stfile import tensor_bytes
from engine.system.disk import bytes_per_token

H = 64


def _aux(n: int, seed: int = 0) -> torch.Tensor:
    """Three capture layers whose magnitudes differ by orders, as a deep target's do."""
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randn(n, H, generator=g) * scale for scale in (0.02, 1.0, 60.0)]
    return torch.cat(layers, dim=1).to(torch.bfloat16)


def test_fp8_record_round_trips_within_e4m3_precision_and_holds_five_eighths_of_the_bytes(tmp_path):
    n = 33
    ids, mask = torch.arange(n), torch.ones(n, dtype=torch.int64)
    aux, final = _aux(n), torch.randn(n, H).to(torch.bfloat16)
    entry = write_record(tmp_path, 0, "s0", ids, mask, aux, final, aux_format="fp8")
    data = (tmp_path / entry.path).read_bytes()
    assert entry.bytes == len(data) == record_size(n, H, "fp8")
    assert entry.sha256 == hashlib.sha256(data).hexdigest()
    with safe_open(str(tmp_path / entry.path), framework="pt") as handle:  # safetensors' own reader
        assert handle.get_tensor("aux_hidden_state").dtype == torch.float8_e4m3fn
        assert handle.get_tensor("aux_scale").shape == (n, 3)
    loaded = load_record(tmp_path, entry)
    assert set(loaded) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
    assert loaded["aux_hidden_state"].dtype == torch.bfloat16 and torch.equal(loaded["hidden_state"], final)
    exact, got = aux.float().view(n, 3, H), loaded["aux_hidden_state"].float().view(n, 3, H)
    amax = exact.abs().amax(dim=2, keepdim=True)
    # e4m3 keeps 3 mantissa bits (rounding error <= 1/16 of a value); values far below their row's
    # largest fall into its subnormals, whose step is amax / 448 / 2^9; bf16 rounds the result once more.
    bound = exact.abs() / 16 + amax / 448 / 2 ** 9 + exact.abs() / 128
    assert bool((got - exact).abs().le(bound).all()), float(((got - exact).abs() / bound).max())
    relative = ((got - exact).norm(dim=2) / exact.norm(dim=2)).max()
    assert float(relative) < 0.04, float(relative)  # each layer alike, whatever its magnitude
    assert verify_record(tmp_path, entry, H) is None
    bf16 = write_record(tmp_path, 1, "s1", ids, mask, aux, final)
    per_token = bytes_per_token(H, "fp8") / bytes_per_token(H)  # 0.66 at this width, 0.63 at 4096
    assert abs(entry.bytes - per_token * bf16.bytes) < 200  # the headers differ
    assert bytes_per_token(H, "fp8") == 5 * H + 28 and bytes_per_token(H) == 8 * H + 16


def test_fp8_records_refuse_non_finite_states_and_report_damage(tmp_path):
    n = 5
    ids, mask, final = torch.arange(n), torch.ones(n, dtype=torch.int64), torch.randn(n, H).to(torch.bfloat16)
    aux = _aux(n)
    aux[2, 7] = float("nan")  # a NaN would hide behind its row's scale: caught before quantizing
    with pytest.raises(RecordError, match="non-finite"):
        write_record(tmp_path, 0, "nan", ids, mask, aux, final, aux_format="fp8")
    with pytest.raises(RecordError, match="non-finite"):
        quantize_sources([tensor_bytes(aux.contiguous())], H)
    q, scale = quantize_sources([tensor_bytes(_aux(n).contiguous())], H)  # finite: no RecordError
    damaged = bytearray(q[0])
    damaged[11] = 0x7F  # e4m3fn's NaN
    with pytest.raises(RecordError, match="non-finite"):
        write_record_stream(tmp_path, 1, "q", tensor_bytes(ids), tensor_bytes(mask), [damaged],
                            [tensor_bytes(final)], H, aux_format="fp8", aux_scale=scale)
    with pytest.raises(RecordError, match="aux_scale"):
        write_record_stream(tmp_path, 2, "short", tensor_bytes(ids), tensor_bytes(mask), q,
                            [tensor_bytes(final)], H, aux_format="fp8", aux_scale=bytes(scale)[:-4])
    assert not list(tmp_path.rglob("*.safetensors")) and not list(tmp_path.rglob("*.tmp"))
    entry = write_record(tmp_path, 3, "ok", ids, mask, _aux(n), final, aux_format="fp8")
    path = tmp_path / entry.path
    data = bytearray(path.read_bytes())
    data[-3 * H - 5] ^= 0x01
    path.write_bytes(bytes(data))
    assert "checksum mismatch" in (verify_record(tmp_path, entry, H) or "")
    with pytest.raises(RecordError, match="checksum mismatch"):
        load_record(tmp_path, entry)


def test_a_zero_row_quantizes_to_zeros(tmp_path):
    n = 4
    aux = _aux(n)
    aux[1] = 0
    entry = write_record(tmp_path, 0, "z", torch.arange(n), torch.ones(n, dtype=torch.int64), aux,
                         torch.randn(n, H).to(torch.bfloat16), aux_format="fp8")
    loaded = load_record(tmp_path, entry)["aux_hidden_state"]
    assert torch.equal(loaded[1], torch.zeros(3 * H, dtype=torch.bfloat16))
    assert bool(torch.isfinite(loaded.float()).all())


def test_extraction_writes_fp8_records_the_trainer_and_specforge_export_read_as_bf16(tiny_chat_model_dir, tmp_path):
    """The real capture path (a local server, Extractor.write_capture) into two runs of one workspace,
    bf16 and fp8: the fp8 run holds e4m3 states (safetensors says so), 0.63 of the bytes at this width,
    its states within e4m3's precision of the bf16 run's; the extract stage passes on it; a run cannot
    change format on resume; the trainer trains on it; the SpecForge export writes bf16 from it."""
    import asyncio

    from engine.checks.context import CheckContext
    from engine.config import set_value
    from engine.extract.job import Extractor
    from engine.extract.guard import ExtractionRefused
    from engine.model.target import workspace_plan
    from engine.pipeline import Pipeline
    from engine.records import read_manifest, read_run_meta
    from engine.server.manager import ServerManager
    from engine.specforge_export import export_specforge
    from engine.train.loop import Trainer
    from tests.helpers.workspaces import make_workspace, write_conversations

    ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir, **{"dataset.path": "train.jsonl", "extract.run": "bf",
                                                                   "train.epochs": 1, "train.eval_fraction": 0.2})
    write_conversations(ws.root / "train.jsonl", 8)
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    try:
        assert asyncio.run(Extractor(ws).run()) == 0
        bf_dir = ws.hidden_dir
        ws.save_config(set_value(set_value(ws.config, "extract.run", "f8"), "extract.aux_format", "fp8"))
        ws.reload()
        assert asyncio.run(Extractor(ws).run()) == 0
        f8_dir = ws.hidden_dir
        ws.save_config(set_value(ws.config, "extract.aux_format", "bf16"))  # resume the fp8 run as bf16
        ws.reload()
        with pytest.raises(ExtractionRefused, match="aux_format='fp8', now 'bf16'"):
            asyncio.run(Extractor(ws).run())
        ws.save_config(set_value(ws.config, "extract.aux_format", "fp8"))
        ws.reload()
    finally:
        asyncio.run(manager.stop(grace=5))
    hidden = workspace_plan(ws).hidden_size
    assert read_run_meta(f8_dir)["aux_format"] == "fp8" and read_run_meta(bf_dir)["aux_format"] == "bf16"
    bf, f8 = read_manifest(bf_dir)[0], read_manifest(f8_dir)[0]
    assert sorted(bf) == sorted(f8) and len(f8) == 8
    tokens = sum(e.tokens for e in f8.values())
    ratio = sum(e.bytes for e in f8.values()) / sum(e.bytes for e in bf.values())
    assert abs(ratio - bytes_per_token(hidden, "fp8") / bytes_per_token(hidden)) < 0.05, ratio
    for sid, entry in f8.items():
        with safe_open(str(f8_dir / entry.path), framework="pt") as handle:
            assert handle.get_tensor("aux_hidden_state").dtype == torch.float8_e4m3fn
        exact = load_record(bf_dir, bf[sid])["aux_hidden_state"].float()
        got = load_record(f8_dir, entry)["aux_hidden_state"].float()
        err = ((got - exact).view(-1, 3, hidden).norm(dim=2) / exact.view(-1, 3, hidden).norm(dim=2).clamp_min(1e-6))
        assert float(err.max()) < 0.05, (sid, float(err.max()))
    report = asyncio.run(Pipeline(CheckContext(ws)).run_stage("extract"))
    assert report.state.value == "passed", [r.to_dict() for r in report.results]
    trainer = Trainer(ws, max_steps=3)
    assert trainer.run() == 0 and trainer.step == 3
    result = export_specforge(ws.path(ws.config.extract.output_dir), "f8", tmp_path / "sf")
    written = list((tmp_path / "sf").rglob("*.ckpt"))
    assert len(written) == 8 and result is not None
    sample = torch.load(written[0], weights_only=True)
    assert sample["aux_hidden_state"].dtype == torch.bfloat16 and sample["aux_hidden_state"].shape[-1] == 3 * hidden
    assert tokens > 0


def test_quantizing_a_file_source_in_blocks_equals_quantizing_it_whole(tmp_path):
    """Spool segments arrive as (fd, offset, length) of a file; they are quantized BLOCK_ROWS tokens at
    a time: the same bytes as all at once, across block edges."""
    import os

    from engine.aux_fp8 import BLOCK_ROWS, quantize

    n = 2 * BLOCK_ROWS + 37
    aux = _aux(n, seed=3)
    path = tmp_path / "segment.bin"
    path.write_bytes(b"x" * 13 + bytes(tensor_bytes(aux.contiguous())))
    fd = os.open(path, os.O_RDONLY)
    try:
        q, scale = quantize_sources([(fd, 13, n * 3 * H * 2)], H)  # finite: no RecordError
        with pytest.raises(RecordError, match="bytes early"):  # a segment cut short, as a bf16 record says
            quantize_sources([(fd, 13, n * 3 * H * 2 + 2 * 3 * H)], H)
    finally:
        os.close(fd)
    whole_q, whole_s = quantize(aux, H)
    assert len(q) == 1
    assert bytes(q[0]) == bytes(tensor_bytes(whole_q.view(torch.uint8)))
    assert bytes(scale) == bytes(tensor_bytes(whole_s))
