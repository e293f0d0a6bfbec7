"""The `disk` stage after records are written (issue 20, case 5).

Found: after a verified extraction the stage stayed red (`needs 18.6 MiB … free 13.3 MiB`): its
budget counted every token of the dataset, including the records already on the disk, so
`run all` stopped at `disk` while the Extraction pane said the run completed clear of the reserve.

Replayed on a real tmpfs output disk holding real records (write_record + manifest, as the
extraction job writes them): the free space is squeezed (a ballast file) to cover only what
remains to be written. The stage must then pass and say how much is written and how much is
still needed; squeezed below what remains it must still fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.workspaces import make_workspace, write_conversations
from engine.checks.base import Status
from engine.checks.context import CheckContext
from engine.system.disk import bytes_per_token, fmt_bytes, records_bytes
from faults import ledger
from faults.helpers import HIDDEN, tmpfs

RESERVE = 256 * 1024  # bytes; 2**-12 GiB is exact as a float
N = 60


def _budget(tokens: int, samples: int, aux_format: str = "bf16") -> int:
    """What the `disk` stage budgets for `samples` records of `tokens` tokens (states, headers, manifest lines)."""
    return records_bytes(tokens, samples, HIDDEN, aux_format)


def _leave_free(disk, free: int) -> None:
    """Write a ballast so that `free` bytes (± a page) stay free on the tmpfs `disk`."""
    ballast = disk / "ballast.bin"
    ballast.unlink(missing_ok=True)
    now = os.statvfs(disk)
    excess = now.f_bavail * now.f_frsize - free
    assert excess > 0, f"the disk has only {now.f_bavail * now.f_frsize} bytes free, wanted {free}"
    with open(ballast, "wb") as handle:
        handle.write(b"\0" * excess)
        handle.flush()
        os.fsync(handle.fileno())


def _write_records(ws, samples) -> int:
    """Write the records of `samples` as the extraction job does; returns their bytes."""
    import torch

    from engine.records import append_manifest, write_record

    total = 0
    generator = torch.Generator().manual_seed(0)
    for sample in samples:
        t = len(sample.input_ids)
        aux = torch.randn(t, 3 * HIDDEN, generator=generator).to(torch.bfloat16)
        final = torch.randn(t, HIDDEN, generator=generator).to(torch.bfloat16)
        entry = write_record(ws.hidden_dir, sample.index, sample.id, torch.tensor(sample.input_ids),
                             torch.tensor(sample.loss_mask), aux, final)
        append_manifest(ws.hidden_dir, entry)
        total += entry.bytes
    return total


def _budget_result(ws):
    from engine.checks.disk import check_disk

    (result,) = [r for r in check_disk(CheckContext(ws)) if r.name == "budget"]
    return result


def test_disk_budget_counts_records_already_written(tiny_chat_model_dir, tmp_path):
    from engine.checks.dataset import check_dataset
    from engine.extract.plan import build_plan
    from engine.records import write_run_meta

    out = tmp_path / "out"
    with tmpfs(out, "8m"):
        ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir, **{
            "dataset.path": "train.jsonl", "extract.output_dir": str(out),
            "extract.disk_reserve_gb": RESERVE / 2**30})
        write_conversations(ws.root / "train.jsonl", N)
        assert all(r.status is not Status.FAIL for r in check_dataset(CheckContext(ws)))  # exact token count
        plan = build_plan(ws)
        total_tokens = plan.total_tokens
        ws.hidden_dir.mkdir(parents=True)
        write_run_meta(ws.hidden_dir, {"model": str(ws.model_dir), "hidden_size": HIDDEN, "layers": [1, 2, 3],
                                       "dataset": plan.dataset, "fingerprint": plan.fingerprint,
                                       "max_seq_len": ws.config.dataset.max_seq_len,
                                       "num_samples": len(plan.samples), "dtype": "bfloat16"})
        trials = 0

        # Half the samples written (an interrupted run): free space for the rest, not for all of it.
        half = len(plan.samples) // 2
        written = _write_records(ws, plan.samples[:half])
        remaining_tokens = sum(len(s.input_ids) for s in plan.samples[half:])
        need_rest = _budget(remaining_tokens, len(plan.samples) - half)
        need_all = _budget(total_tokens, len(plan.samples))
        assert need_all - need_rest > 64 * 1024, "the test needs a clear gap between the two budgets"
        _leave_free(out, RESERVE + (need_rest + need_all) // 2)
        result = _budget_result(ws)
        trials += 1
        assert result.status is Status.PASS, f"{result.status.value}: {result.evidence}"
        assert "already written" in result.evidence and fmt_bytes(written) in result.evidence, result.evidence
        assert f"{remaining_tokens:,} tokens still to write" in result.evidence, result.evidence
        assert fmt_bytes(need_rest) in result.evidence, result.evidence
        print(f"\n  disk budget, half written: {result.evidence}")

        # Less free than what remains: still red, naming what remains.
        _leave_free(out, RESERVE + need_rest // 2)
        result = _budget_result(ws)
        trials += 1
        assert result.status is Status.FAIL, result.evidence
        assert fmt_bytes(need_rest) in result.evidence and "already written" in result.evidence, result.evidence

        # The run completed: nothing left to write, so the stage passes however little is free.
        (out / "ballast.bin").unlink()
        written += _write_records(ws, plan.samples[half:])
        (ws.hidden_dir / "complete.json").write_text(json.dumps({"samples": len(plan.samples), "bad": 0}))
        _leave_free(out, RESERVE + need_all // 4)
        result = _budget_result(ws)
        trials += 1
        assert result.status is Status.PASS, f"{result.status.value}: {result.evidence}"
        assert f"all {total_tokens:,} tokens already written" in result.evidence, result.evidence
        assert fmt_bytes(written) in result.evidence, result.evidence

        # Under the reserve with nothing left to write: amber (the disk is short), not red.
        _leave_free(out, RESERVE // 2)
        result = _budget_result(ws)
        trials += 1
        assert result.status is Status.WARN and "under its reserve" in result.fix, result
        _leave_free(out, RESERVE + need_all // 4)
        print(f"\n  disk budget: {result.evidence}")

        # The same through the command line, as `run all` sees it.
        done = subprocess.run([sys.executable, "-m", "eagle3_console", "check", "disk", "--json", "-w", str(ws.root)],
                              capture_output=True, text=True, timeout=120)
        trials += 1
        report = json.loads(done.stdout)
        (stage,) = report["stages"]
        assert stage["state"] == "passed", (stage, done.stderr[-2000:])
        assert done.returncode == 0
        ledger.add("disk budget after records written", trials=trials, faults=trials - 1, records=len(plan.samples))


def test_fp8_budget_vouches_for_fp8_records_and_bf16_on_the_same_disk_is_red(tiny_chat_model_dir, tmp_path):
    """`extract.aux_format = "fp8"` budgets 5H + 28 bytes a token. On a disk with room for that and not for
    bf16's 8H + 16, the stage passes under fp8 and every fp8 record then fits; the same disk under bf16
    is red (the budget is the format's, not a fixed figure)."""
    import torch

    from engine.checks.dataset import check_dataset
    from engine.config import set_value
    from engine.extract.plan import build_plan
    from engine.records import append_manifest, record_header, write_record, write_run_meta

    out = tmp_path / "out"
    with tmpfs(out, "8m"):
        ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir, **{
            "dataset.path": "train.jsonl", "extract.output_dir": str(out), "extract.aux_format": "fp8",
            "extract.disk_reserve_gb": RESERVE / 2**30})
        write_conversations(ws.root / "train.jsonl", N)
        assert all(r.status is not Status.FAIL for r in check_dataset(CheckContext(ws)))  # exact token count
        plan = build_plan(ws)
        tokens = plan.total_tokens
        need_fp8, need_bf16 = _budget(tokens, len(plan.samples), "fp8"), _budget(tokens, len(plan.samples))
        assert need_bf16 - need_fp8 > 64 * 1024, "the test needs a clear gap between the two budgets"
        _leave_free(out, RESERVE + (need_fp8 + need_bf16) // 2)
        result = _budget_result(ws)
        assert result.status is Status.PASS, f"{result.status.value}: {result.evidence}"
        assert fmt_bytes(need_fp8) in result.evidence, result.evidence

        ws.save_config(set_value(ws.config, "extract.aux_format", "bf16"))
        ws.reload()
        result = _budget_result(ws)
        assert result.status is Status.FAIL, result.evidence
        assert fmt_bytes(need_bf16) in result.evidence, result.evidence

        ws.save_config(set_value(ws.config, "extract.aux_format", "fp8"))
        ws.reload()
        write_run_meta(ws.hidden_dir, {"model": str(ws.model_dir), "hidden_size": HIDDEN, "layers": [1, 2, 3],
                                       "dataset": plan.dataset, "fingerprint": plan.fingerprint,
                                       "max_seq_len": ws.config.dataset.max_seq_len, "aux_format": "fp8",
                                       "num_samples": len(plan.samples), "dtype": "bfloat16"})
        generator, written, headers = torch.Generator().manual_seed(0), 0, 0  # what the fp8 budget vouched for
        for sample in plan.samples:
            t = len(sample.input_ids)
            entry = write_record(ws.hidden_dir, sample.index, sample.id, torch.tensor(sample.input_ids),
                                 torch.tensor(sample.loss_mask), torch.randn(t, 3 * HIDDEN, generator=generator),
                                 torch.randn(t, HIDDEN, generator=generator), aux_format="fp8")
            append_manifest(ws.hidden_dir, entry)
            written, headers = written + entry.bytes, headers + len(record_header(t, HIDDEN, "fp8"))
        # The budget's bytes a token are the records' exactly, and it covers every record's header and
        # manifest line on top (RECORD_OVERHEAD_BYTES each).
        assert written - headers == tokens * bytes_per_token(HIDDEN, "fp8"), (written, headers, tokens)
        on_disk = written + (ws.hidden_dir / "manifest.jsonl").stat().st_size
        assert on_disk <= need_fp8, (on_disk, need_fp8)
        (ws.hidden_dir / "complete.json").write_text(json.dumps({"samples": len(plan.samples), "bad": 0}))
        result = _budget_result(ws)
        assert result.status is Status.PASS and f"all {tokens:,} tokens already written" in result.evidence, \
            result.evidence
        # A bf16 extraction would not resume these fp8 records (run.json's aux_format): not counted as written.
        ws.save_config(set_value(ws.config, "extract.aux_format", "bf16"))
        ws.reload()
        result = _budget_result(ws)
        assert "made with other settings and are not counted" in result.evidence, result.evidence
    print(f"\n  fp8 budget: {fmt_bytes(need_fp8)} for {tokens:,} tokens (bf16 {fmt_bytes(need_bf16)}); "
          f"records written {fmt_bytes(written)}, {fmt_bytes(headers)} of it headers")
    ledger.add("fp8 disk budget vs bf16 on one disk", trials=2, faults=1, records=len(plan.samples), losses=0)
