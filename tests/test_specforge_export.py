"""`eagle3-console data export RUN --format specforge DIR`, judged by SpecForge's own offline loader.

The run is real: the tiny chat model served by the local server, extracted by the console's
Extractor (as in test_extract.py). Its export is then read back two ways:

* as files: every `*.ckpt` is the dict SpecForge's scripts/prepare_hidden_states.py writes, equal
  to our records bit for bit (states with SpecForge's leading batch dimension);
* by SpecForge's code, in a subprocess so none of it enters this process, along the offline
  trainer's own path (specforge/launch.py): the built-in registry's EAGLE3 offline provider ->
  its `build_reader` (OfflineManifestReader; SPECFORGE_VALIDATE_OFFLINE_FEATURES=1 makes it open
  and check every file up front) -> LocalFeatureStore -> FeatureDataLoader with the provider's
  normalizer and collator (DataCollatorWithPadding), batches of 2 so padding is exercised; and
  `count_effective_feature_tokens`, the counter its vocab mapping is built from.

SpecForge's source is never part of this repository. It comes from $EAGLE3_SPECFORGE_SRC (a
checkout), else a cache of the pinned commit (~/.cache/eagle3-console/specforge-<commit>), else a
`git fetch` of that commit from github.com into the cache; when none works the SpecForge test is
skipped with the reason.

One stub, only where the `datasets` package is not installed: an empty `datasets` module with a
placeholder `Dataset` class. specforge/data/utils.py imports `datasets.Dataset` at module level for
`prepare_dp_dataloaders`' type hint only; the collator this test runs never touches it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.workspaces import make_workspace, write_conversations
from engine.records import load_record, load_token_counts, read_manifest, read_run_meta
from engine.release import output_dir_of
from engine.specforge_export import SPECFORGE_COMMIT, SUMMARY, ExportError, export_specforge, specforge_relpath

ROOT = Path(__file__).resolve().parent.parent
N_SAMPLES = 5
SPECFORGE_URL = "https://github.com/sgl-project/SpecForge"
SPECFORGE_MARKER = "specforge/runtime/data_plane/offline_reader.py"


# ----------------------------------------------------------------------------- a real run


def _extracted_ws(root: Path, model_dir: Path, **changes):
    """A workspace whose run1 is a finished real extraction of N_SAMPLES conversations."""
    from engine.extract.job import Extractor
    from engine.server.manager import ServerManager

    ws = make_workspace(root / "ws", model_dir, **{"dataset.path": "train.jsonl", "extract.concurrency": 2,
                                                   **changes})
    write_conversations(ws.root / "train.jsonl", N_SAMPLES)
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    try:
        assert asyncio.run(Extractor(ws).run()) == 0
    finally:
        asyncio.run(manager.stop(grace=5))
    return ws


@pytest.fixture(scope="module")
def run_ws(tiny_chat_model_dir, tmp_path_factory):
    return _extracted_ws(tmp_path_factory.mktemp("sf_export"), tiny_chat_model_dir)


@pytest.fixture(scope="module")
def run_ws_fp8(tiny_chat_model_dir, tmp_path_factory):
    """The same, its records' aux states in fp8 (engine.aux_fp8): exported as the bf16 they read back as."""
    return _extracted_ws(tmp_path_factory.mktemp("sf_export_fp8"), tiny_chat_model_dir, **{"extract.aux_format": "fp8"})


def _copy_run(ws, name: str) -> Path:
    target = output_dir_of(ws) / name
    shutil.copytree(ws.hidden_dir, target)
    return target


def _cli(ws, *args):
    return subprocess.run([sys.executable, "-m", "eagle3_console.cli", "data", *args, "-w", str(ws.root)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def _records(ws) -> dict[int, dict]:
    entries, problems = read_manifest(ws.hidden_dir)
    assert not problems
    return {e.index: load_record(ws.hidden_dir, e) for e in entries.values()}


# ----------------------------------------------------------------------------- the files


def test_export_writes_specforge_files_equal_to_the_records(run_ws, tmp_path):
    dest = tmp_path / "sf"
    result = export_specforge(output_dir_of(run_ws), "run1", dest)
    records = _records(run_ws)
    assert result.files == N_SAMPLES == len(records)
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*.ckpt"))
    assert files == sorted(specforge_relpath(i) for i in records)
    assert sorted(p.name for p in dest.iterdir()) == ["eagle3_console_export.json", "rows_0-2000"]
    hidden = read_run_meta(run_ws.hidden_dir)["hidden_size"]
    for index, record in records.items():
        sample = torch.load(dest / specforge_relpath(index), weights_only=True)
        assert list(sample) == ["input_ids", "loss_mask", "aux_hidden_state", "hidden_state"]
        t = record["input_ids"].shape[0]
        assert sample["input_ids"].dtype == sample["loss_mask"].dtype == torch.int64
        assert sample["aux_hidden_state"].shape == (1, t, 3 * hidden)
        assert sample["hidden_state"].shape == (1, t, hidden)
        assert sample["aux_hidden_state"].dtype == sample["hidden_state"].dtype == torch.bfloat16
        assert torch.equal(sample["input_ids"], record["input_ids"])
        assert torch.equal(sample["loss_mask"], record["loss_mask"])
        assert torch.equal(sample["aux_hidden_state"][0], record["aux_hidden_state"])
        assert torch.equal(sample["hidden_state"][0], record["hidden_state"])
    summary = json.loads((dest / SUMMARY).read_text())
    assert summary["aux_hidden_state_layers"] == read_run_meta(run_ws.hidden_dir)["layers"]
    assert summary["samples"] == N_SAMPLES and summary["run"] == "run1"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left behind"


def test_cli_export_and_an_empty_target_directory(run_ws, tmp_path):
    dest = tmp_path / "empty"
    dest.mkdir()
    proc = _cli(run_ws, "export", "run1", "--format", "specforge", str(dest))
    assert proc.returncode == 0, proc.stderr
    assert f"exported run run1: {N_SAMPLES} records" in proc.stdout
    assert len(list(dest.rglob("*.ckpt"))) == N_SAMPLES


@pytest.mark.parametrize("case", ["unknown", "unfinished", "corrupted", "missing", "not_empty", "file", "inside"])
def test_refusals_name_the_problem_and_write_nothing(run_ws, tmp_path, case):
    out = output_dir_of(run_ws)
    run, dest = "run1", tmp_path / "sf"
    if case == "unknown":
        run, expect = "nope", "no run 'nope' in"
    elif case == "unfinished":
        run = f"unfinished{os.getpid()}"
        (_copy_run(run_ws, run) / "complete.json").unlink()
        expect = "is not finished"
    elif case in ("corrupted", "missing"):
        run = f"{case}{os.getpid()}"
        copy = _copy_run(run_ws, run)
        entries, _ = read_manifest(copy)
        victim = copy / sorted(entries.values(), key=lambda e: e.index)[-1].path  # the last: others get written first
        if case == "missing":
            victim.unlink()
            expect = "missing. Resume the extraction"
        else:
            data = bytearray(victim.read_bytes())
            data[-5] ^= 0xFF  # inside the tensor bytes: still a readable safetensors file
            victim.write_bytes(bytes(data))
            expect = "checksum mismatch"
    elif case == "not_empty":
        dest.mkdir()
        (dest / "keep.txt").write_text("mine")
        expect = "is not empty"
    elif case == "file":
        dest.write_text("a file")
        expect = "is a file"
    else:
        dest, expect = run_ws.hidden_dir / "export", "is inside the run"
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ExportError, match=expect):
        export_specforge(out, run, dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing written, no temporary left"
    if case == "not_empty":
        assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    proc = _cli(run_ws, "export", run, "--format", "specforge", str(dest))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert expect in proc.stderr


# ----------------------------------------------------------------------------- SpecForge's own loader


def _fetch_specforge(cache: Path) -> str | None:
    """Fetch the pinned commit into `cache`; None on success, else why not."""
    git = shutil.which("git")
    if git is None:
        return "git is not installed"
    cache.parent.mkdir(parents=True, exist_ok=True)
    work = cache.parent / f".{cache.name}.{os.getpid()}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    steps = [["init", "-q", str(work)],
             ["-C", str(work), "fetch", "-q", "--depth", "1", SPECFORGE_URL, SPECFORGE_COMMIT],
             ["-C", str(work), "checkout", "-q", "FETCH_HEAD"]]
    for step in steps:
        try:
            proc = subprocess.run([git, *step], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            shutil.rmtree(work, ignore_errors=True)
            return f"`git {step[2] if step[0] == '-C' else step[0]}` timed out"
        if proc.returncode != 0:
            shutil.rmtree(work, ignore_errors=True)
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return lines[-1] if lines else f"git exited {proc.returncode}"
    shutil.rmtree(work / ".git", ignore_errors=True)
    try:
        os.rename(work, cache)
    except OSError:  # another session put it there first
        shutil.rmtree(work, ignore_errors=True)
    return None


@pytest.fixture(scope="module")
def specforge_src() -> Path:
    env = os.environ.get("EAGLE3_SPECFORGE_SRC")
    if env:
        src = Path(env)
        assert (src / SPECFORGE_MARKER).is_file(), f"EAGLE3_SPECFORGE_SRC={env} is not a SpecForge checkout"
        return src
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = cache_root / "eagle3-console" / f"specforge-{SPECFORGE_COMMIT[:12]}"
    if not (cache / SPECFORGE_MARKER).is_file():
        why = _fetch_specforge(cache)
        if why is not None:
            pytest.skip(f"SpecForge source absent: fetching {SPECFORGE_URL} @ {SPECFORGE_COMMIT[:12]} failed "
                        f"({why}); set EAGLE3_SPECFORGE_SRC to a SpecForge checkout to run this check")
    return cache


PROBE = r'''
import importlib.util, os, sys, types
src, features, out = sys.argv[1:4]
stubbed = []
# Asked before SpecForge's checkout joins sys.path: its top-level datasets/ folder (download
# scripts) would otherwise pass for the package as an empty namespace package.
if importlib.util.find_spec("datasets") is None:  # see the test module's docstring
    stub = types.ModuleType("datasets")
    stub.Dataset = type("Dataset", (), {})
    sys.modules["datasets"] = stub
    stubbed.append("datasets")
sys.path.insert(0, src)
import torch
from specforge.algorithms.builtin import builtin_algorithm_registry
from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
from specforge.runtime.data_plane.feature_store import LocalFeatureStore
from specforge.training.vocab_mapping import count_effective_feature_tokens

algorithm = builtin_algorithm_registry().resolve("eagle3")
provider = algorithm.providers.offline_for("text")
max_len = 4096
refs = provider.build_reader(features, run_id="probe", ttt_length=7, max_len=max_len).read()
loader = FeatureDataLoader(
    LocalFeatureStore("probe"), refs=refs, batch_size=2, collate_fn=provider.build_collator(),
    per_sample_transform=provider.build_normalizer(max_len, ttt_length=7, use_usp_preprocess=False),
    drop_last=False, strategy=algorithm.name)
paths = {r.sample_id: r.feature_store_uri[len("file://"):] for r in refs}
batches = [{"paths": [paths[s] for s in b.sample_ids], "tensors": dict(b.tensors)} for b in loader]
counts = dict(count_effective_feature_tokens(features))
torch.save({"batches": batches, "refs": [paths[r.sample_id] for r in refs], "counts": counts,
            "specs": {paths[r.sample_id]: {k: (list(v.shape), v.dtype) for k, v in r.feature_specs.items()}
                      for r in refs},
            "stubbed": stubbed, "collator": type(loader.collate_fn).__name__}, out)
'''


@pytest.mark.parametrize("aux_format", ["bf16", "fp8"])
def test_specforge_offline_loader_reads_the_export(specforge_src, aux_format, request, tmp_path):
    run_ws = request.getfixturevalue("run_ws_fp8" if aux_format == "fp8" else "run_ws")
    dest = tmp_path / "sf"
    export_specforge(output_dir_of(run_ws), "run1", dest)
    probe, out = tmp_path / "probe.py", tmp_path / "probe.pt"
    probe.write_text(PROBE)
    env = {**os.environ, "SPECFORGE_VALIDATE_OFFLINE_FEATURES": "1"}
    proc = subprocess.run([sys.executable, str(probe), str(specforge_src), str(dest), str(out)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = torch.load(out, weights_only=False)
    assert seen["collator"] == "DataCollatorWithPadding"

    records = _records(run_ws)
    by_path = {str(dest / specforge_relpath(i)): i for i in records}
    assert sorted(seen["refs"]) == sorted(by_path), "SpecForge lists exactly the exported files"
    hidden = read_run_meta(run_ws.hidden_dir)["hidden_size"]
    for path, specs in seen["specs"].items():  # what its validating reader found in each file
        t = records[by_path[path]]["input_ids"].shape[0]
        assert specs == {"input_ids": ([t], "int64"), "loss_mask": ([t], "int64"),
                         "hidden_state": ([1, t, hidden], "bfloat16"),
                         "aux_hidden_state": ([1, t, 3 * hidden], "bfloat16")}

    loaded = []
    for batch in seen["batches"]:
        tensors = batch["tensors"]
        width = tensors["input_ids"].shape[1]
        assert width == max(records[by_path[p]]["input_ids"].shape[0] for p in batch["paths"])
        for row, path in enumerate(batch["paths"]):
            record = records[by_path[path]]
            t = record["input_ids"].shape[0]
            expected_mask = record["loss_mask"].clone()
            expected_mask[-1] = 0  # SpecForge's normalizer drops the last position (no next token)
            assert torch.equal(tensors["input_ids"][row, :t], record["input_ids"])
            assert torch.equal(tensors["loss_mask"][row, :t], expected_mask)
            assert torch.equal(tensors["attention_mask"][row, :t], torch.ones(t, dtype=torch.long))
            # the draft's input: our aux (three layers, low -> high); its target: our post-norm state
            assert torch.equal(tensors["hidden_state"][row, :t], record["aux_hidden_state"])
            assert torch.equal(tensors["target"][row, :t], record["hidden_state"])
            for key in ("input_ids", "loss_mask", "attention_mask", "hidden_state", "target"):
                assert not tensors[key][row, t:].any(), f"{key} padding"
            loaded.append(path)
    assert sorted(loaded) == sorted(by_path), "every sample reached a batch exactly once"

    ours = load_token_counts(run_ws.hidden_dir)
    assert seen["counts"] == {i: int(c) for i, c in enumerate(ours.tolist()) if c}, \
        "SpecForge's vocab-mapping token counts equal the run's token_counts"
