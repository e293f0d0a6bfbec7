"""Tests for engine.system.disk on real directories (and a real tmpfs mount when running as root)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.system.disk import (
    DiskSampler,
    DiskUsage,
    bytes_per_token,
    fmt_bytes,
    parse_size,
    usage_for,
    usage_for_paths,
)

MiB = 1 << 20


def test_usage_for_existing_dir_matches_statvfs(tmp_path: Path) -> None:
    usage = usage_for("hidden", tmp_path, reserve_bytes=MiB)
    expected = shutil.disk_usage(tmp_path)
    assert usage.label == "hidden" and usage.path == str(tmp_path)
    assert usage.total == expected.total and usage.total > 0
    assert abs(usage.free - expected.free) < 64 * MiB  # other writers share the disk
    assert os.path.ismount(usage.mount)
    assert str(tmp_path).startswith(usage.mount)
    assert usage.reserve == MiB
    assert usage.available_after_reserve == max(0, usage.free - MiB)


def test_usage_for_nonexistent_nested_path_uses_ancestor(tmp_path: Path) -> None:
    target = tmp_path / "not" / "yet" / "created"
    usage = usage_for("drafters", target)
    assert usage.path == str(target)
    assert not target.exists()  # measuring must not create anything
    assert usage.mount == usage_for("x", tmp_path).mount
    assert usage.total == shutil.disk_usage(tmp_path).total


def test_usage_for_rejects_negative_reserve(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserve"):
        usage_for("x", tmp_path, reserve_bytes=-1)


def test_reserve_properties() -> None:
    usage = DiskUsage("a", "/a", "/", total=100, used=60, free=40, reserve=50)
    assert usage.below_reserve is True and usage.available_after_reserve == 0
    usage = DiskUsage("a", "/a", "/", total=100, used=10, free=90, reserve=50)
    assert usage.below_reserve is False and usage.available_after_reserve == 40


def test_usage_for_paths_merges_same_mount(tmp_path: Path) -> None:
    (tmp_path / "hidden").mkdir()
    paths = {"hidden": tmp_path / "hidden", "drafters": tmp_path / "drafters" / "run1", "eval": tmp_path}
    result = usage_for_paths(paths, reserve_bytes=MiB)
    assert len(result) == 1
    assert result[0].label == "hidden, drafters, eval"
    assert result[0].path == str(tmp_path / "hidden")
    assert result[0].reserve == MiB


def test_usage_for_paths_keeps_distinct_mounts(tmp_path: Path) -> None:
    proc = Path("/proc")
    if not os.path.ismount(proc) or os.stat(proc).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /proc as a separate mount")
    result = usage_for_paths({"work": tmp_path, "proc": proc}, reserve_bytes=0)
    assert [u.label for u in result] == ["work", "proc"]
    assert result[1].mount == "/proc"


def test_bytes_per_token() -> None:
    assert bytes_per_token(7168) == 57360
    assert fmt_bytes(bytes_per_token(7168)) == "56.0 KiB"
    assert bytes_per_token(64) == 2 * 256 + 16
    assert bytes_per_token(7168, "fp8") == 5 * 7168 + 28  # 0.62 of bf16 at Kimi-K2.5's width
    with pytest.raises(ValueError):
        bytes_per_token(0)
    with pytest.raises(ValueError):
        bytes_per_token(64, "fp16")


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (57360, "56.0 KiB"),
        (int(1.2 * 2**40), "1.2 TiB"),
        (1024 * 1024 - 1, "1.0 MiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_fmt_bytes(n: int, text: str) -> None:
    assert fmt_bytes(n) == text


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("50G", 50 * 2**30),
        ("50GB", 50 * 2**30),
        ("50GiB", 50 * 2**30),
        ("50 gib", 50 * 2**30),
        ("50Gi", 50 * 2**30),
        ("1.5T", int(1.5 * 2**40)),
        ("800M", 800 * 2**20),
        ("56.0 KiB", 56 * 1024),
        ("4k", 4096),
        ("1048576", 1048576),
        ("512B", 512),
        (" 7 ", 7),
        (123, 123),
    ],
)
def test_parse_size(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "fifty", "50X", "-5G", "1.5", "G", "5 5G", "5ib", "1e9", "50GiBs"])
def test_parse_size_rejects_with_clear_message(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)


def test_parse_format_round_trip() -> None:
    for n in [1, 999, 4096, 57360, 3 * 2**30 + 12345, int(1.9 * 2**40), 7 * 2**50]:
        back = parse_size(fmt_bytes(n))
        assert abs(back - n) <= n * 0.05  # one decimal place loses at most 5%
        assert fmt_bytes(back) == fmt_bytes(n)


def test_disk_sampler_sample(tmp_path: Path) -> None:
    sampler = DiskSampler({"hidden": tmp_path / "hidden", "drafters": tmp_path}, reserve_bytes=MiB)
    result = sampler.sample()
    assert [u.label for u in result] == ["hidden, drafters"]
    assert sampler.last_error is None
    with pytest.raises(ValueError):
        DiskSampler({}, reserve_bytes=0, interval=0)


async def test_disk_sampler_watch_and_cancel(tmp_path: Path) -> None:
    sampler = DiskSampler({"ws": tmp_path}, reserve_bytes=0, interval=0.02)
    received: list[list[DiskUsage]] = []
    task = asyncio.create_task(sampler.watch(received.append))
    for _ in range(200):
        if len(received) >= 3:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(received) >= 3 and all(r[0].label == "ws" for r in received)
    count = len(received)
    await asyncio.sleep(0.1)
    assert len(received) == count


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A real 4 MiB tmpfs mount (root on Linux only)."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting tmpfs needs root on Linux")
    mount_dir = tmp_path / "small"
    mount_dir.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_dir)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"tmpfs mount failed: {done.stderr.strip() or done.returncode}")
    try:
        yield mount_dir
    finally:
        subprocess.run(["umount", str(mount_dir)], capture_output=True, timeout=30)


def test_real_tmpfs_reserve_flips_when_filled(small_tmpfs: Path, tmp_path: Path) -> None:
    reserve = 1 * MiB
    out = small_tmpfs / "hidden" / "run1"  # not created yet
    before = usage_for("hidden", out, reserve_bytes=reserve)
    assert before.mount == str(small_tmpfs)
    assert before.total == 4 * MiB
    assert before.free > 3.9 * MiB and before.below_reserve is False
    # The sampler sees the tmpfs as its own filesystem, apart from the workspace disk.
    sampler = DiskSampler({"hidden": out, "workspace": tmp_path}, reserve_bytes=reserve)
    assert [u.label for u in sampler.sample()] == ["hidden", "workspace"]

    out.mkdir(parents=True)
    with open(out / "shard-0000.bin", "wb") as handle:
        handle.write(b"\0" * int(3.5 * MiB))
        handle.flush()
        os.fsync(handle.fileno())
    after = usage_for("hidden", out, reserve_bytes=reserve)
    assert after.free < reserve
    assert after.below_reserve is True
    assert after.available_after_reserve == 0
    assert after.used >= int(3.5 * MiB)
