"""The weights id: the same weights anywhere give one id; other weights, or another config, another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from engine.model.weights_id import BLOCK, SAMPLES, weights_id, weights_mismatch


def test_a_copy_has_the_id_of_its_original_and_a_fine_tune_does_not(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    original = weights_id(tiny_model_dir)
    assert original is not None and len(original) == 16
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(tiny_model_dir, moved)
    assert weights_id(moved) == original
    # one tensor trained a little: everything else (names, shapes, file size) the same
    path = moved / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] + 1e-2
    save_file(tensors, path, metadata={"format": "pt"})
    assert path.stat().st_size == (tiny_model_dir / "model.safetensors").stat().st_size
    assert weights_id(moved) != original


def test_config_changes_and_sampled_bytes_change_the_id(tiny_model_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) * 2
    (model / "config.json").write_text(json.dumps(config))
    assert weights_id(model) != weights_id(tiny_model_dir)

    big = tmp_path / "big"
    big.mkdir()
    shard = big / "model-00001-of-00001.safetensors"
    data = bytearray(4 * SAMPLES * BLOCK)
    shard.write_bytes(data)
    before = weights_id(big)
    data[-1] ^= 0xFF  # the last block is always read
    shard.write_bytes(data)
    assert weights_id(big) != before


def test_no_weight_files_means_nothing_to_compare(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert weights_id(tmp_path) is None
    meta = {"model_weights": "0123456789abcdef", "model": "/models/a"}
    assert weights_mismatch(meta, Path("/models/b"), None) is None
    assert weights_mismatch({"model": "/models/a"}, Path("/models/b"), "fedcba9876543210") is None  # an older run
    assert weights_mismatch(meta, Path("/models/b"), "0123456789abcdef") is None
    said = weights_mismatch(meta, Path("/models/b"), "fedcba9876543210")
    assert said == ("its records were captured from weights 0123456789abcdef (/models/a), but model.path /models/b "
                    "holds weights fedcba9876543210")
    said = weights_mismatch(meta, Path("/models/a"), "fedcba9876543210")  # the same path: the files were replaced
    assert said == ("its records were captured from weights 0123456789abcdef, but the files at model.path /models/a "
                    "now hold weights fedcba9876543210 (replaced since)")


def test_a_remembered_id_is_read_again_when_a_file_changes(tmp_path, monkeypatch):
    """Polls ask every second, so an id is remembered by the files' inode, size and mtime; a rewrite (a new
    mtime, even with the same size and inode) is read again, and a file written within the last RACY_S
    seconds is never remembered (file times are coarse)."""
    import os
    import time

    import engine.model.weights_id as module

    shard = tmp_path / "model.safetensors"
    shard.write_bytes(bytes(4 * SAMPLES * BLOCK))
    past = time.time() - 7200
    os.utime(shard, (past, past))
    reads: list[Path] = []
    real = module._sampled_id
    monkeypatch.setattr(module, "_sampled_id", lambda d, files: reads.append(d) or real(d, files))
    first = weights_id(tmp_path)
    assert weights_id(tmp_path) == first and len(reads) == 1  # remembered
    with open(shard, "r+b") as handle:  # in place: same inode and size
        handle.seek(len(handle.read()) - 1)
        handle.write(b"\x01")
    monkeypatch.setattr(module, "RACY_S", 3600.0)  # "just now" however slow this machine is
    fresh = weights_id(tmp_path)
    assert fresh != first and len(reads) == 2
    assert weights_id(tmp_path) == fresh and len(reads) == 3  # written "just now": read each time
