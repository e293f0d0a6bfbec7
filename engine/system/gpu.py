"""GPU sampling over NVML (nvidia-ml-py), safe when the library, driver or GPU is absent.

Every NVML call goes through `_query`, which turns an NVML error (an unsupported field, a
missing function in an old driver, a lost GPU) into None, so one bad field never hides the
rest. `GpuSampler.sample()` never raises: with no NVML it returns a snapshot with
`available=False` and a reason a person can act on.

Fields that change every second (utilisation, memory, temperature, power, clocks) are read on
every call; fields that change rarely (names, capability, max clocks, PCIe link, processes,
interconnect) are cached for `slow_interval` seconds, the way nvitop splits its TTL caches.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

try:  # nvidia-ml-py is a dependency, but a broken install must not crash the console
    import pynvml
except Exception:  # pragma: no cover - exercised only on a broken install
    pynvml = None

try:
    import psutil
except Exception:  # pragma: no cover
    psutil = None


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_memory: int | None  # bytes; None where the driver does not say (e.g. MIG, WDDM)


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    uuid: str
    compute_capability: tuple[int, int] | None
    utilization_gpu: int | None  # percent
    utilization_memory: int | None  # percent of time the memory bus was busy
    memory_used: int | None  # bytes
    memory_total: int | None  # bytes
    temperature_c: int | None
    power_w: float | None
    power_limit_w: float | None
    sm_clock_mhz: int | None
    max_sm_clock_mhz: int | None
    pcie_gen: int | None
    pcie_width: int | None
    processes: tuple[GpuProcess, ...] = ()

    @property
    def architecture(self) -> str:
        return architecture_name(self.compute_capability)

    @property
    def memory_free(self) -> int | None:
        if self.memory_used is None or self.memory_total is None:
            return None
        return max(0, self.memory_total - self.memory_used)


@dataclass(frozen=True)
class GpuSnapshot:
    available: bool
    reason: str  # "" when available; otherwise why not, starting "NVML unavailable: "
    driver_version: str | None
    cuda_driver_version: str | None  # e.g. "12.8", the newest CUDA the driver supports
    gpus: tuple[GpuSample, ...]
    interconnect: str
    timestamp: float  # wall clock (time.time()) when sampled

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (tuples become lists), with each GPU's architecture."""
        data = asdict(self)
        for gpu_dict, gpu in zip(data["gpus"], self.gpus):
            gpu_dict["architecture"] = gpu.architecture
            if gpu.compute_capability is not None:
                gpu_dict["compute_capability"] = list(gpu.compute_capability)
            gpu_dict["processes"] = [asdict(p) for p in gpu.processes]
        data["gpus"] = list(data["gpus"])
        return data


# ----------------------------------------------------------------------------- architecture names

# Compute capability -> marketing family. Minor versions split families only for 7.x and 8.x.
_FAMILY_BY_CC: dict[tuple[int, int], str] = {
    (7, 5): "Turing",
    (8, 9): "Ada",
}
_FAMILY_BY_MAJOR: dict[int, str] = {
    3: "Kepler",
    5: "Maxwell",
    6: "Pascal",
    7: "Volta",
    8: "Ampere",
    9: "Hopper",
    10: "Blackwell",  # SM100/SM103: B200, GB200, B300
    11: "Blackwell",  # SM110: Jetson Thor
    12: "Blackwell",  # SM120/SM121: RTX PRO 6000, RTX 50xx, DGX Spark
}


def architecture_name(cc: tuple[int, int] | None) -> str:
    """(9, 0) -> "Hopper SM90", (12, 0) -> "Blackwell SM120"; None -> "unknown"."""
    if cc is None:
        return "unknown"
    major, minor = cc
    sm = f"SM{major}{minor}"
    family = _FAMILY_BY_CC.get((major, minor)) or _FAMILY_BY_MAJOR.get(major)
    return f"{family} {sm}" if family else sm


# ----------------------------------------------------------------------------- NVML helpers


def _query(func_name: str, *args: Any) -> Any:
    """Call pynvml.<func_name>(*args); None on any NVML error or a function this pynvml lacks."""
    func = getattr(pynvml, func_name, None)
    if func is None:
        return None
    try:
        return func(*args)
    except pynvml.NVMLError:
        return None
    except (AttributeError, TypeError, ValueError, OSError):
        # Version skew between nvidia-ml-py and the driver shows up as odd struct errors.
        return None


def _query_first(*calls: tuple[Any, ...]) -> Any:
    """First non-None result of several (func_name, *args) alternatives (new API, then old)."""
    for func_name, *args in calls:
        value = _query(func_name, *args)
        if value is not None:
            return value
    return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _nvml_error_text(error: BaseException) -> str:
    """A reason a person can act on, for the errors seen when there is no usable GPU."""
    name = type(error).__name__
    if name == "NVMLError_LibraryNotFound":
        return "NVML library not found (libnvidia-ml.so.1; is the NVIDIA driver installed?)"
    if name == "NVMLError_DriverNotLoaded":
        return "NVIDIA driver not loaded (check `nvidia-smi`)"
    if name == "NVMLError_NoPermission":
        return "no permission to open the NVIDIA driver (check /dev/nvidia* permissions)"
    if name == "NVMLError_LibRmVersionMismatch":
        return "NVML/driver version mismatch (reboot or reload the nvidia kernel module)"
    try:
        text = str(error)
    except Exception:
        text = ""
    return text or name


def _milliwatts_to_watts(value: Any) -> float | None:
    return None if value is None else round(value / 1000.0, 1)


def _cuda_version_text(value: Any) -> str | None:
    # NVML encodes CUDA 12.8 as 12080.
    if not isinstance(value, int) or value <= 0:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}"


# ----------------------------------------------------------------------------- interconnect

_TOPOLOGY_LABELS = {  # nvidia-smi topo -m names for the common-ancestor levels
    0: "INTERNAL",  # two GPUs on one board
    10: "PIX",  # one PCIe switch
    20: "PXB",  # several PCIe switches, no host bridge
    30: "PHB",  # through the CPU's host bridge
    40: "NODE",  # across host bridges within one NUMA node
    50: "SYS",  # across NUMA nodes (the SMP interconnect)
}


def _active_nvlinks(handle: Any) -> int | None:
    """Active NVLink links of one GPU; 0 when it has none; None when NVML can't tell."""
    max_links = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)
    enabled = getattr(pynvml, "NVML_FEATURE_ENABLED", 1)
    active = 0
    answered = False
    for link in range(max_links):
        try:
            state = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError as error:
            if type(error).__name__ == "NVMLError_NotSupported" and link == 0:
                return 0  # no NVLink on this GPU
            continue  # links past the GPU's count answer InvalidArgument
        except Exception:
            continue
        answered = True
        if state == enabled:
            active += 1
    return active if answered else None


def summarize_interconnect(handles: list[Any]) -> str:
    """One line for the GPU pane: how the GPUs talk to each other.

    NVLink wins when any link is active. Otherwise the PCIe level is the farthest common
    ancestor over all GPU pairs, since a ring collective runs at the speed of its slowest hop.
    """
    if not handles:
        return "unknown"
    if len(handles) == 1:
        return "single GPU"
    link_counts = [_active_nvlinks(h) for h in handles]
    known_counts = [c for c in link_counts if c is not None]
    if known_counts and max(known_counts) > 0:
        low, high = min(known_counts), max(known_counts)
        span = str(high) if low == high else f"{low}-{high}"
        return f"NVLink ({span} active links per GPU)"
    levels = []
    for i in range(len(handles)):
        for j in range(i + 1, len(handles)):
            level = _query("nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j])
            if level is not None:
                levels.append(int(level))
    if not levels:
        return "unknown"
    worst = max(levels)
    return f"PCIe ({_TOPOLOGY_LABELS.get(worst, f'level {worst}')})"


# ----------------------------------------------------------------------------- sampler


@dataclass(frozen=True)
class _SlowInfo:
    """Per-GPU fields refreshed every slow_interval."""

    name: str
    uuid: str
    compute_capability: tuple[int, int] | None
    max_sm_clock_mhz: int | None
    pcie_gen: int | None
    pcie_width: int | None
    processes: tuple[GpuProcess, ...]


def _process_name(pid: int) -> str:
    # psutil first: NVML's name lookup fails for processes in other PID namespaces.
    if psutil is not None:
        try:
            return psutil.Process(pid).name()
        except Exception:
            pass
    return _text(_query("nvmlSystemGetProcessName", pid)) or "?"


def _gpu_processes(handle: Any) -> tuple[GpuProcess, ...]:
    found: dict[int, GpuProcess] = {}
    for func_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        for info in _query(func_name, handle) or ():
            pid = getattr(info, "pid", None)
            if not isinstance(pid, int) or pid in found:
                continue
            used = getattr(info, "usedGpuMemory", None)
            found[pid] = GpuProcess(pid=pid, name=_process_name(pid), used_memory=used if isinstance(used, int) else None)
    return tuple(sorted(found.values(), key=lambda p: p.pid))


def _slow_info(handle: Any) -> _SlowInfo:
    cc = _query("nvmlDeviceGetCudaComputeCapability", handle)
    sm_clock = getattr(pynvml, "NVML_CLOCK_SM", 1)
    return _SlowInfo(
        name=_text(_query("nvmlDeviceGetName", handle)) or "unknown GPU",
        uuid=_text(_query("nvmlDeviceGetUUID", handle)) or "",
        compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
        max_sm_clock_mhz=_query("nvmlDeviceGetMaxClockInfo", handle, sm_clock),
        pcie_gen=_query("nvmlDeviceGetCurrPcieLinkGeneration", handle),
        pcie_width=_query("nvmlDeviceGetCurrPcieLinkWidth", handle),
        processes=_gpu_processes(handle),
    )


def _fast_sample(index: int, handle: Any, slow: _SlowInfo) -> GpuSample:
    util = _query("nvmlDeviceGetUtilizationRates", handle)
    memory = _query("nvmlDeviceGetMemoryInfo", handle)
    sensor = getattr(pynvml, "NVML_TEMPERATURE_GPU", 0)
    temperature = _query_first(
        ("nvmlDeviceGetTemperatureV", handle, sensor),  # the non-deprecated call, newer drivers
        ("nvmlDeviceGetTemperature", handle, sensor),
    )
    power_limit = _query_first(
        ("nvmlDeviceGetEnforcedPowerLimit", handle),
        ("nvmlDeviceGetPowerManagementLimit", handle),
    )
    return GpuSample(
        index=index,
        name=slow.name,
        uuid=slow.uuid,
        compute_capability=slow.compute_capability,
        utilization_gpu=getattr(util, "gpu", None),
        utilization_memory=getattr(util, "memory", None),
        memory_used=getattr(memory, "used", None),
        memory_total=getattr(memory, "total", None),
        temperature_c=temperature,
        power_w=_milliwatts_to_watts(_query("nvmlDeviceGetPowerUsage", handle)),
        power_limit_w=_milliwatts_to_watts(power_limit),
        sm_clock_mhz=_query("nvmlDeviceGetClockInfo", handle, getattr(pynvml, "NVML_CLOCK_SM", 1)),
        max_sm_clock_mhz=slow.max_sm_clock_mhz,
        pcie_gen=slow.pcie_gen,
        pcie_width=slow.pcie_width,
        processes=slow.processes,
    )


class GpuSampler:
    """Samples all visible GPUs; blocking `sample()`, or `watch()` from asyncio.

    Thread-safe: `watch()` runs `sample()` in a worker thread, and a check may call it too.
    `clock` is for tests (the slow-field cache ages by it); leave it as default otherwise.
    """

    def __init__(
        self,
        fast_interval: float = 1.0,
        slow_interval: float = 5.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if fast_interval <= 0 or slow_interval <= 0:
            raise ValueError("GPU sampling intervals must be positive seconds")
        self.fast_interval = fast_interval
        self.slow_interval = slow_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._initialized = False
        self._init_failed_at: float | None = None
        self._init_error = ""
        self._handles: list[Any] = []
        self._slow: list[_SlowInfo] = []
        self._slow_at: float | None = None
        self._driver_version: str | None = None
        self._cuda_driver_version: str | None = None
        self._interconnect = "unknown"

    # -- lifecycle

    def _ensure_init(self) -> bool:
        if self._initialized:
            return True
        now = self._clock()
        # A missing driver stays missing; don't retry the library load on every fast tick.
        if self._init_failed_at is not None and now - self._init_failed_at < self.slow_interval:
            return False
        if pynvml is None:
            self._init_error = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            self._init_failed_at = now
            return False
        try:
            pynvml.nvmlInit()
        except Exception as error:  # NVMLError, or a corrupt pynvml (AttributeError)
            self._init_error = _nvml_error_text(error)
            self._init_failed_at = now
            return False
        self._initialized = True
        self._init_failed_at = None
        self._slow_at = None
        return True

    def close(self) -> None:
        """Shut NVML down; a later `sample()` initialises it again."""
        with self._lock:
            if self._initialized:
                try:
                    pynvml.nvmlShutdown()
                except Exception:
                    pass
            self._initialized = False
            self._handles = []
            self._slow = []
            self._slow_at = None

    def __enter__(self) -> GpuSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sampling

    def _unavailable(self, reason: str) -> GpuSnapshot:
        return GpuSnapshot(
            available=False,
            reason=f"NVML unavailable: {reason}",
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_driver_version,
            gpus=(),
            interconnect="unknown",
            timestamp=time.time(),
        )

    def _refresh_slow(self) -> None:
        count = _query("nvmlDeviceGetCount") or 0
        handles = []
        for index in range(count):
            handle = _query("nvmlDeviceGetHandleByIndex", index)
            if handle is not None:
                handles.append(handle)
        self._handles = handles
        self._slow = [_slow_info(h) for h in handles]
        self._driver_version = _text(_query("nvmlSystemGetDriverVersion"))
        self._cuda_driver_version = _cuda_version_text(
            _query_first(("nvmlSystemGetCudaDriverVersion_v2",), ("nvmlSystemGetCudaDriverVersion",))
        )
        self._interconnect = summarize_interconnect(handles)
        self._slow_at = self._clock()

    def _sample_locked(self) -> GpuSnapshot:
        if not self._ensure_init():
            return self._unavailable(self._init_error)
        if self._slow_at is None or self._clock() - self._slow_at >= self.slow_interval:
            self._refresh_slow()
        if not self._handles:
            return self._unavailable("no GPUs visible")
        gpus = tuple(_fast_sample(i, h, s) for i, (h, s) in enumerate(zip(self._handles, self._slow)))
        return GpuSnapshot(
            available=True,
            reason="",
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_driver_version,
            gpus=gpus,
            interconnect=self._interconnect,
            timestamp=time.time(),
        )

    def sample(self) -> GpuSnapshot:
        """One snapshot of every visible GPU. Blocking (NVML calls); never raises."""
        with self._lock:
            try:
                return self._sample_locked()
            except Exception as error:  # a bug or a driver fault must not take the console down
                return self._unavailable(f"sampling failed: {type(error).__name__}: {error}")

    async def watch(self, callback: Callable[[GpuSnapshot], Any]) -> None:
        """Sample every fast_interval forever, off the event loop; cancel the task to stop.

        `callback` may be a plain function or a coroutine function. The next sample is
        scheduled from when this one started, so a slow NVML call doesn't stretch the period.
        """
        await _watch_loop(self.sample, callback, self.fast_interval)


async def _watch_loop(sample: Callable[[], Any], callback: Callable[[Any], Any], interval: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        result = await asyncio.to_thread(sample)
        outcome = callback(result)
        if inspect.isawaitable(outcome):
            await outcome
        await asyncio.sleep(max(0.0, interval - (loop.time() - started)))
