"""Tests for engine.system.gpu.

The first group runs against the real environment, where NVML is really absent (no driver,
no GPU on this machine). The fake-device tests monkeypatch pynvml functions because no GPU
exists here; the NVML-present path is verified on the lent H200 separately.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pynvml
import pytest

from engine.system.gpu import GpuSampler, GpuSnapshot, architecture_name


def _nvml_really_absent() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return True
    pynvml.nvmlShutdown()
    return False


needs_no_nvml = pytest.mark.skipif(not _nvml_really_absent(), reason="NVML is present on this machine")


# ----------------------------------------------------------------------------- real: NVML absent


@needs_no_nvml
def test_sample_without_nvml_reports_unavailable() -> None:
    sampler = GpuSampler()
    snapshot = sampler.sample()
    assert snapshot.available is False
    assert snapshot.reason.startswith("NVML unavailable")
    assert "not found" in snapshot.reason or "driver" in snapshot.reason
    assert snapshot.gpus == ()
    assert snapshot.interconnect == "unknown"
    # Repeated calls and close() never raise either.
    assert sampler.sample().available is False
    sampler.close()
    sampler.close()
    assert sampler.sample().reason.startswith("NVML unavailable")


@needs_no_nvml
def test_unavailable_snapshot_is_json_serialisable() -> None:
    data = GpuSampler().sample().to_dict()
    text = json.dumps(data)
    back = json.loads(text)
    assert back["available"] is False
    assert back["gpus"] == []
    assert back["reason"].startswith("NVML unavailable")


@needs_no_nvml
async def test_watch_delivers_snapshots_and_cancels_cleanly() -> None:
    sampler = GpuSampler(fast_interval=0.02)
    received: list[GpuSnapshot] = []
    task = asyncio.create_task(sampler.watch(received.append))
    for _ in range(200):
        if len(received) >= 3:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(received) >= 3
    assert all(isinstance(s, GpuSnapshot) and not s.available for s in received)
    count = len(received)
    await asyncio.sleep(0.1)
    assert len(received) == count  # nothing after cancellation


async def test_watch_awaits_async_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = GpuSampler(fast_interval=0.01)
    seen: list[float] = []

    async def callback(snapshot: GpuSnapshot) -> None:
        await asyncio.sleep(0)
        seen.append(snapshot.timestamp)

    task = asyncio.create_task(sampler.watch(callback))
    for _ in range(200):
        if len(seen) >= 2:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(seen) >= 2 and seen == sorted(seen)


def test_invalid_intervals_rejected() -> None:
    with pytest.raises(ValueError, match="positive"):
        GpuSampler(fast_interval=0)


# ----------------------------------------------------------------------------- architecture names


@pytest.mark.parametrize(
    ("cc", "expected"),
    [
        ((9, 0), "Hopper SM90"),
        ((12, 0), "Blackwell SM120"),
        ((10, 0), "Blackwell SM100"),
        ((8, 0), "Ampere SM80"),
        ((8, 6), "Ampere SM86"),
        ((8, 9), "Ada SM89"),
        ((7, 5), "Turing SM75"),
        ((7, 0), "Volta SM70"),
        ((42, 1), "SM421"),
        (None, "unknown"),
    ],
)
def test_architecture_name(cc: tuple[int, int] | None, expected: str) -> None:
    assert architecture_name(cc) == expected


# ----------------------------------------------------------------------------- fake NVML


class FakeNvml:
    """A fake NVML with N devices. Fake because no GPU exists here; the real path is
    verified on the lent H200 separately. Handles are ints; `unsupported` names the
    functions that raise NVMLError_NotSupported, as a real driver does for some fields."""

    def __init__(self, count: int = 1, nvlinks: int = 0, ancestor: int = pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
                 unsupported: tuple[str, ...] = ()) -> None:
        self.count = count
        self.nvlinks = nvlinks
        self.ancestor = ancestor
        self.unsupported = set(unsupported)
        self.calls: dict[str, int] = {}
        self.shutdowns = 0

    def _fn(self, name: str, result):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.unsupported:
                raise pynvml.NVMLError_NotSupported()
            return result(*args) if callable(result) else result
        return call

    def nvlink_state(self, handle: int, link: int) -> int:
        if self.nvlinks == 0:
            raise pynvml.NVMLError_NotSupported()
        if link >= 18:
            raise pynvml.NVMLError_InvalidArgument()
        return pynvml.NVML_FEATURE_ENABLED if link < self.nvlinks else pynvml.NVML_FEATURE_DISABLED

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def shutdown() -> None:
            self.shutdowns += 1

        table = {
            "nvmlInit": None,
            "nvmlShutdown": lambda: shutdown(),
            "nvmlDeviceGetCount": self.count,
            "nvmlDeviceGetHandleByIndex": lambda i: 100 + i,
            "nvmlSystemGetDriverVersion": "580.65.06",
            "nvmlSystemGetCudaDriverVersion_v2": 13000,
            "nvmlSystemGetCudaDriverVersion": 13000,
            "nvmlDeviceGetName": lambda h: f"NVIDIA RTX PRO 6000 #{h - 100}",
            "nvmlDeviceGetUUID": lambda h: f"GPU-fake-{h}",
            "nvmlDeviceGetCudaComputeCapability": (12, 0),
            "nvmlDeviceGetMaxClockInfo": 2617,
            "nvmlDeviceGetCurrPcieLinkGeneration": 5,
            "nvmlDeviceGetCurrPcieLinkWidth": 16,
            "nvmlDeviceGetComputeRunningProcesses": [SimpleNamespace(pid=1, usedGpuMemory=2 << 30)],
            "nvmlDeviceGetGraphicsRunningProcesses": [SimpleNamespace(pid=1, usedGpuMemory=2 << 30),
                                                      SimpleNamespace(pid=999_999_999, usedGpuMemory=None)],
            "nvmlSystemGetProcessName": "ghost",
            "nvmlDeviceGetUtilizationRates": SimpleNamespace(gpu=87, memory=40),
            "nvmlDeviceGetMemoryInfo": SimpleNamespace(used=10 << 30, total=96 << 30, free=86 << 30),
            "nvmlDeviceGetTemperatureV": 61,
            "nvmlDeviceGetTemperature": 61,
            "nvmlDeviceGetPowerUsage": 312_345,
            "nvmlDeviceGetEnforcedPowerLimit": 600_000,
            "nvmlDeviceGetPowerManagementLimit": 600_000,
            "nvmlDeviceGetClockInfo": 2400,
            "nvmlDeviceGetNvLinkState": self.nvlink_state,
            "nvmlDeviceGetTopologyCommonAncestor": self.ancestor,
        }
        for name, result in table.items():
            monkeypatch.setattr(pynvml, name, self._fn(name, result))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_fake_device_full_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(count=1)
    fake.install(monkeypatch)
    snapshot = GpuSampler().sample()
    assert snapshot.available is True and snapshot.reason == ""
    assert snapshot.driver_version == "580.65.06"
    assert snapshot.cuda_driver_version == "13.0"
    assert snapshot.interconnect == "single GPU"
    (gpu,) = snapshot.gpus
    assert gpu.index == 0 and gpu.name == "NVIDIA RTX PRO 6000 #0" and gpu.uuid == "GPU-fake-100"
    assert gpu.compute_capability == (12, 0) and gpu.architecture == "Blackwell SM120"
    assert (gpu.utilization_gpu, gpu.utilization_memory) == (87, 40)
    assert (gpu.memory_used, gpu.memory_total, gpu.memory_free) == (10 << 30, 96 << 30, 86 << 30)
    assert gpu.temperature_c == 61
    assert gpu.power_w == pytest.approx(312.3) and gpu.power_limit_w == 600.0
    assert (gpu.sm_clock_mhz, gpu.max_sm_clock_mhz, gpu.pcie_gen, gpu.pcie_width) == (2400, 2617, 5, 16)
    # pid 1 appears in both lists once; an unknown pid falls back to NVML's name.
    assert [(p.pid, p.used_memory) for p in gpu.processes] == [(1, 2 << 30), (999_999_999, None)]
    assert gpu.processes[1].name == "ghost"
    data = json.loads(json.dumps(snapshot.to_dict()))
    assert data["gpus"][0]["compute_capability"] == [12, 0]
    assert data["gpus"][0]["architecture"] == "Blackwell SM120"
    assert data["gpus"][0]["processes"][0]["pid"] == 1


def test_unsupported_fields_become_none_not_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(
        count=1,
        unsupported=(
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetEnforcedPowerLimit",
            "nvmlDeviceGetTemperatureV",  # new call missing -> falls back to the old one
            "nvmlDeviceGetCurrPcieLinkGeneration",
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
        ),
    )
    fake.install(monkeypatch)
    gpu = GpuSampler().sample().gpus[0]
    assert gpu.power_w is None
    assert gpu.power_limit_w == 600.0  # PowerManagementLimit fallback
    assert gpu.temperature_c == 61
    assert gpu.pcie_gen is None and gpu.pcie_width == 16
    assert gpu.processes == ()
    assert gpu.utilization_gpu == 87  # other fields unaffected


def test_everything_unsupported_still_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [
        "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetCudaComputeCapability",
        "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo",
        "nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion",
    ]
    FakeNvml(count=1, unsupported=tuple(names)).install(monkeypatch)
    snapshot = GpuSampler().sample()
    assert snapshot.available is True
    gpu = snapshot.gpus[0]
    assert gpu.name == "unknown GPU" and gpu.uuid == "" and gpu.compute_capability is None
    assert gpu.utilization_gpu is None and gpu.memory_total is None and gpu.temperature_c is None
    assert snapshot.driver_version is None and snapshot.cuda_driver_version is None
    json.dumps(snapshot.to_dict())


def test_zero_gpus_reports_no_gpus_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(count=0).install(monkeypatch)
    snapshot = GpuSampler().sample()
    assert snapshot.available is False
    assert snapshot.reason == "NVML unavailable: no GPUs visible"
    assert snapshot.driver_version == "580.65.06"


def test_init_failure_reason_and_retry_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = []

    def failing_init() -> None:
        attempts.append(1)
        raise pynvml.NVMLError_DriverNotLoaded()

    monkeypatch.setattr(pynvml, "nvmlInit", failing_init)
    clock = FakeClock()
    sampler = GpuSampler(slow_interval=5.0, clock=clock)
    assert sampler.sample().reason == "NVML unavailable: NVIDIA driver not loaded (check `nvidia-smi`)"
    sampler.sample()
    assert len(attempts) == 1  # not retried on every fast tick
    clock.now += 5.0
    sampler.sample()
    assert len(attempts) == 2


def test_unexpected_exception_never_escapes(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(count=1)
    fake.install(monkeypatch)

    def boom():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", boom)
    snapshot = GpuSampler().sample()
    assert snapshot.available is False
    assert "driver exploded" in snapshot.reason and snapshot.reason.startswith("NVML unavailable")


def test_slow_fields_cached_fast_fields_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(count=2)
    fake.install(monkeypatch)
    clock = FakeClock()
    sampler = GpuSampler(fast_interval=1.0, slow_interval=5.0, clock=clock)
    for _ in range(3):
        sampler.sample()
        clock.now += 1.0
    assert fake.calls["nvmlDeviceGetName"] == 2  # once per GPU
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 2
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 6  # per GPU per call
    clock.now += 2.0  # now 5 s since the slow refresh
    sampler.sample()
    assert fake.calls["nvmlDeviceGetName"] == 4
    sampler.close()
    assert fake.shutdowns == 1


@pytest.mark.parametrize(
    ("count", "nvlinks", "ancestor", "expected"),
    [
        (1, 0, pynvml.NVML_TOPOLOGY_SYSTEM, "single GPU"),
        (2, 18, pynvml.NVML_TOPOLOGY_SYSTEM, "NVLink (18 active links per GPU)"),
        (4, 0, pynvml.NVML_TOPOLOGY_SINGLE, "PCIe (PIX)"),
        (4, 0, pynvml.NVML_TOPOLOGY_MULTIPLE, "PCIe (PXB)"),
        (2, 0, pynvml.NVML_TOPOLOGY_HOSTBRIDGE, "PCIe (PHB)"),
        (2, 0, pynvml.NVML_TOPOLOGY_NODE, "PCIe (NODE)"),
        (8, 0, pynvml.NVML_TOPOLOGY_SYSTEM, "PCIe (SYS)"),
    ],
)
def test_interconnect_summary(monkeypatch: pytest.MonkeyPatch, count: int, nvlinks: int, ancestor: int,
                              expected: str) -> None:
    FakeNvml(count=count, nvlinks=nvlinks, ancestor=ancestor).install(monkeypatch)
    assert GpuSampler().sample().interconnect == expected


def test_interconnect_takes_farthest_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(count=3).install(monkeypatch)
    # GPUs 0-1 share a switch, GPU 2 sits across the CPU socket link.
    levels = {(100, 101): pynvml.NVML_TOPOLOGY_SINGLE, (100, 102): pynvml.NVML_TOPOLOGY_SYSTEM,
              (101, 102): pynvml.NVML_TOPOLOGY_SYSTEM}
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTopologyCommonAncestor", lambda a, b: levels[(a, b)])
    assert GpuSampler().sample().interconnect == "PCIe (SYS)"


def test_interconnect_unknown_when_nvml_cannot_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(count=2, unsupported=("nvmlDeviceGetTopologyCommonAncestor",)).install(monkeypatch)
    assert GpuSampler().sample().interconnect == "unknown"
