"""Which SGLang releases the backend supports, and everything that differs between them.

Every version-specific fact (flag spellings, where the capture hook attaches, how the aux
layer ids are numbered, how a worker finds its rank) lives in the VersionProfile table
below, so supporting a new release means adding one entry after reading its source.

Facts were read from the PyPI wheels' source (0.5.9, 0.5.16, 0.5.20, 0.5.22, 0.5.23):
- `--enable-return-aux-hidden-states` (capture aux states on a target without a draft)
  exists only from 0.5.23. Older releases pass aux states to the logits processor only
  when a real EAGLE-3 draft is loaded (`--speculative-algorithm EAGLE3` + draft path),
  which turns every prefill into speculative traffic: unusable for capture. So 0.5.23 is
  the only release our official-flags capture works on; older ones are refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from engine.errors import EngineError

DISTRIBUTION = "sglang"


@dataclass(frozen=True)
class VersionProfile:
    version: str
    # Flags emitted on every launch, with the reason shown in LaunchSpec.notes.
    base_flags: tuple[tuple[tuple[str, ...], str], ...]
    # Flags emitted during capture, with the reason shown in LaunchSpec.notes.
    capture_flags: tuple[tuple[tuple[str, ...], str], ...]
    # Turns on SGLang's own EAGLE-3 aux capture without loading a draft.
    aux_capture_flags: tuple[str, ...]
    aux_layer_ids_flag: str
    # fnmatch pattern over model.named_modules() for the module our hook attaches to.
    hook_target: str
    health_check_prefix: str
    # Dotted callables tried in order by the hook to find its rank among the writers.
    rank_functions: tuple[str, ...] = ()
    # Flags a user may not add through server.extra_args while capturing (they break it).
    capture_forbidden: tuple[str, ...] = ()


PROFILES: dict[str, VersionProfile] = {
    profile.version: profile
    for profile in (
        VersionProfile(
            version="0.5.23",
            capture_flags=(
                (("--disable-radix-cache",),
                 "radix cache off: a cached prefix is never recomputed, so its hidden states would never be captured"),
                (("--disable-prefill-cuda-graph",),
                 "prefill CUDA graphs off: 0.5.23 runs prefill under breakable graphs by default, and Python forward "
                 "hooks fire only on the eager forward"),
                # No all-reduce-fusion switch: 0.5.23 takes aux states from the residual stream after the
                # previous contribution is reduced and added (python/sglang/srt/layers/layer_boundary/
                # stage.py:461-485 in AttentionStage.prepare; capture_output at stage.py:299 completes owed
                # work first), so a fused all-reduce never hands the capture a per-rank partial sum.
            ),
            base_flags=(
                (("--enable-metrics",), "metrics on: /metrics feeds the console's throughput and cache-hit gauges"),
                (("--skip-server-warmup",), "warmup request skipped: nothing but real requests reaches the spool"),
            ),
            aux_capture_flags=("--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"),
            aux_layer_ids_flag="--return-aux-hidden-state-layer-ids",
            hook_target="*logits_processor",
            health_check_prefix="HEALTH_CHECK",
            rank_functions=(
                # With DP attention: rank inside this DP group's attention-TP group; else the TP group.
                "sglang.srt.layers.dp_attention:get_dp_tp_group",
                "sglang.srt.distributed.parallel_state:get_tp_group",
            ),
            capture_forbidden=(
                "--enable-mixed-chunk", "--speculative-draft-model-path", "--speculative-num-steps",
                "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--cuda-graph-backend-prefill", "--cuda-graph-config",
                "--pp-size", "--pipeline-parallel-size",
            ),
        ),
    )
}

# Releases we read and rejected, with the reason shown to the user.
UNSUPPORTED_REASONS: dict[str, str] = {
    "0.5.22": "no --enable-return-aux-hidden-states (added in 0.5.23)",
    "0.5.20": "no --enable-return-aux-hidden-states (added in 0.5.23)",
    "0.5.16": "no --enable-return-aux-hidden-states (added in 0.5.23)",
    "0.5.9": "no --enable-return-aux-hidden-states, no prefill-graph or all-reduce-fusion switches, "
             "and no request ids on ForwardBatch",
}
OLDER_REASON = ("releases before 0.5.23 have no --enable-return-aux-hidden-states, so the logits processor only "
                "receives aux hidden states with a speculative draft loaded, which breaks capture")


class UnsupportedSglangError(EngineError, RuntimeError):
    """SGLang is missing or its version has no profile; the message says what to install."""


def supported_versions() -> list[str]:
    return sorted(PROFILES, key=_version_key)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _release(version: str) -> str:
    """'0.5.23.post1' / '0.5.23rc0' / '0.5.23+cu129' -> '0.5.23'."""
    match = re.match(r"^(\d+\.\d+\.\d+)", version.strip())
    return match.group(1) if match else version.strip()


def profile_for(version: str) -> VersionProfile:
    """The profile for an installed version string; UnsupportedSglangError with the fix otherwise."""
    release = _release(version)
    profile = PROFILES.get(release)
    if profile is not None:
        return profile
    wanted = ", ".join(supported_versions())
    fix = f"install a supported release: pip install 'sglang=={supported_versions()[-1]}'"
    if release in UNSUPPORTED_REASONS:
        why = UNSUPPORTED_REASONS[release]
    elif _version_key(release) < _version_key(supported_versions()[0]):
        why = OLDER_REASON
    else:
        why = ("this release is newer than the ones whose capture patch points were verified; "
               "its flags and hook points may have moved")
    raise UnsupportedSglangError(f"SGLang {version} is not supported ({why}); supported: {wanted}. Fix: {fix}")


def installed_version() -> str | None:
    """The installed sglang distribution's version, or None when it is not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def detect_profile(version: str | None = None) -> VersionProfile:
    """Profile of the installed SGLang (or of `version`); UnsupportedSglangError when unusable."""
    version = installed_version() if version is None else version
    if version is None:
        raise UnsupportedSglangError(
            "SGLang is not installed in this Python environment "
            f"(model.backend = \"sglang\"). Fix: pip install 'sglang=={supported_versions()[-1]}' "
            "in the environment that runs eagle3-console, or set model.backend = \"local\"")
    return profile_for(version)
