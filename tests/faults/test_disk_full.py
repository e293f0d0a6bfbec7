"""Full disks: the output disk and the capture spool (each a small tmpfs) filled at random moments.

With no reserve configured, writes really fail with ENOSPC. The extraction must pause (never
crash), count no partial record, and complete once the space is freed. A deterministic case
pins the bug this suite found: an append that the full disk cut short left a fragment that the
next append glued onto, corrupting a manifest line in the middle of the file.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import time

import pytest

from engine.io.atomic import append_line
from engine.config import set_value
from engine.records import read_manifest
from faults import ledger, zygote
from faults.helpers import SEED, check_at_rest, check_complete, fault_workspace, plan_ids, tmpfs

CYCLES = 6  # fill/free cycles, alternating output disk and spool


def _fill(directory, name="ballast.bin") -> "os.PathLike":
    """Write until the disk is full; returns the ballast path."""
    path = directory / name
    chunk = b"\0" * 65536
    with open(path, "ab", buffering=0) as handle:
        try:
            while True:
                handle.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        try:
            while True:
                handle.write(b"\0" * 512)
        except OSError:
            pass
    return path


def test_append_cut_short_by_a_full_disk_leaves_no_fragment(tmp_path):
    disk = tmp_path / "disk"
    with tmpfs(disk, "64k"):
        manifest = disk / "manifest.jsonl"
        manifest.write_text("x" * 4000 + "\n")  # the next line crosses into a page the disk cannot give
        ballast = _fill(disk)
        line = json.dumps({"id": "s1", "pad": "y" * 300})
        with pytest.raises(OSError) as info:
            append_line(manifest, line)
        assert info.value.errno == errno.ENOSPC
        assert manifest.read_bytes() == b"x" * 4000 + b"\n", "a partial line was left behind"
        ballast.unlink()
        append_line(manifest, line)
        assert manifest.read_text().splitlines()[1] == line


def test_extraction_pauses_on_full_disks_and_completes_when_freed(tiny_chat_model_dir, shared_server, tmp_path):
    if not shared_server.spool_is_tmpfs:
        pytest.skip("the shared server's spool is not a tmpfs of its own (needs root)")
    out = tmp_path / "out"
    with tmpfs(out, "8m"):
        ws = fault_workspace(tmp_path / "ws", tiny_chat_model_dir, shared_server, n=16,
                             **{"extract.output_dir": str(out), "extract.concurrency": 1})
        expected = plan_ids(ws)
        rng = random.Random(SEED + 4)
        problems, faults, checked = [], 0, 0
        run, cycle = 0, 0
        while cycle < CYCLES:
            job_dir = ws.jobs_dir / f"extract-r{run}"
            proc = zygote.start("extract", ["--workspace", str(ws.root)], job_dir)
            while proc.exitcode is None and cycle < CYCLES:
                time.sleep(rng.uniform(0.1, 0.8))
                if proc.exitcode is not None:
                    break
                disk = ws.hidden_dir if cycle % 2 == 0 else ws.spool_dir
                ws.hidden_dir.mkdir(parents=True, exist_ok=True)
                ballast = _fill(disk.parent if disk == ws.hidden_dir else disk, f"ballast-{cycle}.bin")
                faults += 1
                time.sleep(rng.uniform(0.5, 1.5))
                count, found = check_at_rest(ws.hidden_dir)
                checked += count
                problems += [f"cycle {cycle}: {p}" for p in found]
                ballast.unlink()
                cycle += 1
                if proc.exitcode not in (None, 0):
                    log = (job_dir / "log.txt").read_text()
                    if proc.exitcode == 2 and "no space left on the disk" in log:
                        # The disk filled while the job started or finished: a clear stop, then a restart.
                        job_dir = ws.jobs_dir / f"extract-r{run}-c{cycle}"
                        proc = zygote.start("extract", ["--workspace", str(ws.root)], job_dir)
                    else:
                        problems.append(f"cycle {cycle}: the job died on a full disk: {log[-800:]}")
            proc.join(120)
            if proc.exitcode != 0:
                problems.append(f"run{run}: exit {proc.exitcode}: {(job_dir / 'log.txt').read_text()[-1500:]}")
                break
            # Verify the finished run now and free its records: runs pile up on the 8 MiB disk, and a fast
            # server finishes enough of them to leave the next too little room (which it rightly refuses).
            problems += [f"{ws.hidden_dir.name}: {p}" for p in check_complete(ws.hidden_dir, expected)]
            entries, manifest_problems = read_manifest(ws.hidden_dir)
            problems += manifest_problems
            checked += len(entries)
            shutil.rmtree(ws.hidden_dir)
            run += 1
            ws.save_config(set_value(ws.config, "extract.run", f"run{run}"))
            ws.reload()
        ledger.add("disk full (output, spool)", trials=CYCLES, faults=faults, records=checked, losses=len(problems))
        assert not problems, problems[:5]
