"""`eagle3-console data export RUN --format specforge DIR`: a finished run in SpecForge's offline layout.

Our records are not SpecForge's files: same four key names and meaning, but safetensors named
`<id>.safetensors` with states shaped [T, .], where SpecForge's offline trainer reads torch.save'd
dicts named `*.ckpt` with states shaped [1, T, .]. This module writes what that trainer reads.

What SpecForge reads (sgl-project/SpecForge a6b6b0230009d15ec2a97a57384e6f53f0f96946, 2026-08-08):
  - specforge/runtime/data_plane/offline_reader.py `list_feature_files`: every file under
    `data.hidden_states_path`, recursively, whose name ends in `.ckpt` or `.ckpt.gz`, sorted by
    path; one file is one sample (other files, like our summary JSON, are ignored).
  - feature_store.py `load_feature_file`: `torch.load(path, weights_only=False, mmap=True)`, a dict.
  - keys `input_ids`, `loss_mask`, `hidden_state`, `aux_hidden_state` (offline_reader
    `_OFFLINE_EAGLE3_KEYS`; EAGLE3's OfflineStorageContract "specforge_hidden_states_v1").
  - algorithms/eagle3/data.py `normalize_offline_sample`: `aux_hidden_state.squeeze(0)` is the
    draft's input, `hidden_state.squeeze(0)` the target fed to the target's LM head alone
    (modeling/target/target_head.py: no final norm), so it is the post-final-norm state, as ours.
  - scripts/prepare_hidden_states.py writes `rows_<g>-<g+2000>/data_<i>.ckpt` holding
    input_ids int64 [T], loss_mask int64 [T], aux_hidden_state [1, T, 3H], hidden_state [1, T, H]
    (as captured: bf16 for a bf16 target). This module writes exactly that, from bf16 records.

`aux_hidden_state` holds the outputs of decoder layers run.json `layers` (our numbering: output of
layer i, 0-indexed, = HF hidden_states[i + 1]), low to high. SpecForge never checks them against the
files: its `model.aux_hidden_state_layer_ids` decides what its exported draft config claims, so it
must name the same layers in the numbering SGLang uses for the target's architecture. The summary
file `eagle3_console_export.json` in DIR says which layers the files hold.

Every record is re-hashed against the manifest as it is read; DIR appears only complete (written
under a temporary name beside it, then renamed), and an existing non-empty DIR is never touched.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.extract.layout import COMPLETE, RUN_LOCK
from engine.io import atomic
from engine.io.names import UnsafeNameError, check_name
from engine.records import RecordError, load_record, read_manifest, read_run_meta
from engine.errors import EngineError
from engine.io.jsonfile import read_json_object_or_none

FORMATS = ("specforge",)
SPECFORGE_COMMIT = "a6b6b0230009d15ec2a97a57384e6f53f0f96946"  # the SpecForge source this layout was read from
SPECFORGE_GROUP_SIZE = 2000  # prepare_hidden_states.py --file-group-size default
SUMMARY = "eagle3_console_export.json"  # not *.ckpt: SpecForge's reader skips it
_FILE_OVERHEAD = 4096  # pickle/zip framing per .ckpt, generous


class ExportError(EngineError):
    """Why a run can't be exported, with what to do instead."""


@dataclass(frozen=True)
class ExportResult:
    run: str
    dest: Path
    files: int
    tokens: int
    bytes: int


def specforge_relpath(index: int) -> str:
    """Where SpecForge's prepare_hidden_states.py puts sample `index` (its file-group-size 2000)."""
    group = (index // SPECFORGE_GROUP_SIZE) * SPECFORGE_GROUP_SIZE
    return f"rows_{group}-{group + SPECFORGE_GROUP_SIZE}/data_{index}.ckpt"


def _source_run(output_dir: Path, name: str) -> tuple[Path, dict, list]:
    """The run directory, its run.json and its manifest entries; ExportError unless finished and whole."""
    from engine.workspace import WorkspaceLock

    try:
        check_name(name, "run name")
    except UnsafeNameError as exc:
        raise ExportError(str(exc)) from None
    run_dir = Path(output_dir) / name
    if not run_dir.is_dir() or ".releasing-" in name:
        try:
            known = sorted(p.name for p in Path(output_dir).iterdir()
                           if (p / "run.json").is_file() and ".releasing-" not in p.name)
        except OSError:
            known = []
        there = f"runs there: {', '.join(known)}" if known else "there are no runs there"
        raise ExportError(f"no run {name!r} in {output_dir} ({there}); `eagle3-console data list` shows them")
    try:
        meta = read_run_meta(run_dir)
    except RecordError as exc:
        raise ExportError(f"{exc}; nothing exported") from None
    if WorkspaceLock(run_dir, RUN_LOCK).held_elsewhere():
        raise ExportError(f"an extraction is writing run {name!r} now: wait for it to finish, then export")
    complete = read_json_object_or_none(run_dir / COMPLETE)
    if complete is None:
        raise ExportError(f"run {name!r} is not finished ({run_dir / COMPLETE} missing or unreadable): finish it "
                          f"with `eagle3-console run extract` (extract.run = {name}), then export")
    entries, problems = read_manifest(run_dir)
    if problems:
        raise ExportError(f"run {name!r} has a damaged manifest ({'; '.join(problems[:3])}): resume the extraction "
                          f"(`eagle3-console run extract` with extract.run = {name}) to repair it, then export")
    if not entries:
        raise ExportError(f"run {name!r} has no records: nothing to export")
    if complete.get("samples") != len(entries):
        raise ExportError(f"run {name!r} lists {len(entries)} records but {COMPLETE} says {complete.get('samples')}: "
                          f"resume the extraction (extract.run = {name}) to repair it, then export")
    hidden = meta.get("hidden_size")
    layers = meta.get("layers")
    if not isinstance(hidden, int) or not isinstance(layers, list):
        raise ExportError(f"{run_dir / 'run.json'} lacks hidden_size or layers: it was not written by this "
                          "console's extraction; nothing exported")
    return run_dir, meta, sorted(entries.values(), key=lambda e: e.index)


def _check_dest(dest: Path, run_dir: Path) -> None:
    if dest.is_symlink():
        raise ExportError(f"{dest} is a symlink: give the real directory; nothing exported")
    if dest.exists():
        if not dest.is_dir():
            raise ExportError(f"{dest} is a file: give a new (or empty) directory; nothing exported")
        if any(dest.iterdir()):
            raise ExportError(f"{dest} is not empty: give a new (or empty) directory, nothing there is "
                              "overwritten; nothing exported")
    resolved, source = dest.resolve(), run_dir.resolve()
    if resolved == source or source in resolved.parents:
        raise ExportError(f"{dest} is inside the run {run_dir}: export somewhere else; nothing exported")


def _specforge_sample(tensors: dict, entry, hidden: int) -> dict:
    """One record as SpecForge's feature dict (key order as its OfflineCaptureLayout writes them)."""
    import torch

    aux, final = tensors["aux_hidden_state"], tensors["hidden_state"]
    t = entry.tokens
    if (tuple(tensors["input_ids"].shape) != (t,) or tuple(tensors["loss_mask"].shape) != (t,)
            or tuple(aux.shape) != (t, 3 * hidden) or tuple(final.shape) != (t, hidden)):
        raise RecordError(f"{entry.path}: shapes input_ids {list(tensors['input_ids'].shape)}, aux "
                          f"{list(aux.shape)}, hidden {list(final.shape)} do not fit T={t}, H={hidden}")
    return {
        "input_ids": tensors["input_ids"].to(torch.int64),
        "loss_mask": tensors["loss_mask"].to(torch.int64),
        "aux_hidden_state": aux.unsqueeze(0),
        "hidden_state": final.unsqueeze(0),
    }


def export_specforge(output_dir: Path, run: str, dest: str | os.PathLike,
                     progress: Callable[[int, int], None] | None = None) -> ExportResult:
    """Write run `run` (under extract.output_dir `output_dir`) to `dest` in SpecForge's offline layout."""
    import torch

    run_dir, meta, entries = _source_run(Path(output_dir), run)
    dest = Path(os.path.abspath(dest))
    _check_dest(dest, run_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    need = sum(e.bytes + _FILE_OVERHEAD for e in entries)
    free = shutil.disk_usage(dest.parent).free
    if free < need:
        from engine.system.disk import fmt_bytes

        raise ExportError(f"{dest.parent} has {fmt_bytes(free)} free, the export needs about {fmt_bytes(need)}: "
                          "free space or export elsewhere; nothing exported")
    hidden = int(meta["hidden_size"])
    tmp = dest.parent / f".{dest.name}.export-{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    written, tokens = 0, 0
    try:
        for done, entry in enumerate(entries, 1):
            try:
                tensors = load_record(run_dir, entry, verify=True)
                sample = _specforge_sample(tensors, entry, hidden)
            except RecordError as exc:
                raise ExportError(f"run {run!r}: {exc}. Resume the extraction (extract.run = {run}) to redo the "
                                  "sample, then export; nothing exported") from None
            except FileNotFoundError:
                raise ExportError(f"run {run!r}: {entry.path} missing. Resume the extraction (extract.run = {run}) "
                                  "to redo the sample, then export; nothing exported") from None
            path = tmp / specforge_relpath(entry.index)
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as handle:
                torch.save(sample, handle)
                handle.flush()
                os.fsync(handle.fileno())
            written += path.stat().st_size
            tokens += entry.tokens
            if progress is not None:
                progress(done, len(entries))
        summary = {
            "format": "specforge_hidden_states_v1",
            "written_by": "eagle3-console data export --format specforge",
            "specforge_commit_read": SPECFORGE_COMMIT,
            "run": run,
            "source": str(run_dir),
            "model": meta.get("model"),
            "model_weights": meta.get("model_weights"),
            "samples": len(entries),
            "tokens": tokens,
            "hidden_size": hidden,
            "dtype": "bfloat16",
            "files": "rows_<g>-<g+2000>/data_<index>.ckpt, <index> = the manifest index in the source run",
            "aux_hidden_state_layers": meta["layers"],
            "aux_hidden_state": "[1, T, 3H]: outputs of decoder layers aux_hidden_state_layers (0-indexed, "
                                "= HF hidden_states[i + 1]), concatenated low to high",
            "hidden_state": "[1, T, H]: the post-final-norm state feeding the LM head",
            "loss_mask": "[T] int64: 1 on assistant tokens",
        }
        atomic.write_text(tmp / SUMMARY, json.dumps(summary, indent=2) + "\n")  # fsynced like the samples
        for directory in [*sorted(p for p in tmp.iterdir() if p.is_dir()), tmp]:
            atomic.fsync_dir(directory)
        try:
            os.rename(tmp, dest)  # replaces only a missing or empty directory (ENOTEMPTY otherwise)
        except OSError as exc:
            raise ExportError(f"{dest} could not be put in place ({exc.strerror}): it must be new or empty; "
                              "nothing exported") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic.fsync_dir(dest.parent)
    return ExportResult(run, dest, len(entries), tokens, written)
