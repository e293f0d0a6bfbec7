"""`eagle3-console data [list|release RUN|export RUN DIR]`: the extraction runs under
extract.output_dir, headless: what each holds, releasing (deleting) an old one after saying what it
frees, and writing a finished one in SpecForge's offline layout."""

from __future__ import annotations

import argparse
import json
import sys

from eagle3_console.cliprint import fail


def add_data_parser(sub, leaf: argparse.ArgumentParser) -> None:
    """`leaf`: the -w parent whose default is SUPPRESS, so `eagle3-console -w DIR data list` keeps DIR."""
    p = sub.add_parser("data", help="list, export or release (delete) extraction runs", parents=[leaf])
    actions = p.add_subparsers(dest="data_action", metavar="ACTION")
    actions.required = True
    q = actions.add_parser("list", help="runs under extract.output_dir: records, size, state", parents=[leaf])
    q.add_argument("--verify", action="store_true", help="re-hash every record of finished runs (slow for big runs)")
    q.add_argument("--json", action="store_true")
    q = actions.add_parser("release", help="delete an old run after showing what it frees (asks first)",
                           parents=[leaf])
    q.add_argument("run", metavar="RUN")
    q.add_argument("--confirm", "--yes-i-typed", dest="confirm", metavar="RUN",
                   help="scripts: confirm by giving the run name again (deletes even without a newer run)")
    q.add_argument("--yes", action="store_true",
                   help="scripts: delete without asking when a newer run is verified complete")
    q = actions.add_parser("export", help="write a finished run (re-hashed as read) in SpecForge's offline "
                           "layout", parents=[leaf])
    q.add_argument("run", metavar="RUN")
    q.add_argument("dir", metavar="DIR", help="a new (or empty) directory")
    q.add_argument("--format", required=True, choices=["specforge"],
                   help="specforge: the *.ckpt files SpecForge's offline trainer reads (data.hidden_states_path)")


def cmd_data(ws, args) -> int:
    from engine.release import ReleaseError

    if args.data_action == "export":
        return _data_export(ws, args)
    try:
        return _data_list(ws, args) if args.data_action == "list" else _data_release(ws, args)
    except ReleaseError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"{exc.filename or 'the run'}: {exc.strerror or exc}; nothing more was deleted")


def _data_list(ws, args) -> int:
    import time

    from engine.system.disk import fmt_bytes
    from engine.release import list_runs, output_dir_of

    runs = list_runs(ws, verify=args.verify)
    if args.json:
        print(json.dumps({"output_dir": str(output_dir_of(ws)), "configured": ws.config.extract.run,
                          "runs": [r.to_dict() for r in runs]}, indent=2))
        return 0
    print(f"runs in {output_dir_of(ws)} (extract.run = {ws.config.extract.run}):")
    if not runs:
        print("  none")
    for r in runs:
        mark = "*" if r.name == ws.config.extract.run else " "
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.since)) if r.since else "?"
        print(f"{mark} {r.name:<24} {r.state:<10} {r.records:>8} records {fmt_bytes(r.bytes):>10}  {when}")
        for problem in r.problems[:3]:
            print(f"      ! {problem}")
    if runs and not args.verify:
        print("(complete = finished; add --verify to re-hash the records and show 'verified')")
    return 0


def _ask(prompt: str) -> str | None:
    try:
        return input(prompt).strip()
    except EOFError:  # stdin closed or empty: no answer, which keeps the run
        print(flush=True)
        return None


def _data_release(ws, args) -> int:
    from engine.system.disk import fmt_bytes
    from engine.release import (
        RELEASING,
        describe_run,
        in_use_reason,
        newer_verified_run,
        output_dir_of,
        release_run,
    )

    name = args.run
    info = describe_run(output_dir_of(ws), name)
    print(f"run {info.name}: {info.path}")
    print(f"  {info.records} records, {info.state}; releasing it frees {fmt_bytes(info.bytes)}")
    reason = in_use_reason(ws, name)
    if reason:
        return fail(f"not released: {reason}")
    if args.confirm is not None and args.confirm != name:
        return fail(f"--confirm {args.confirm!r} does not match the run name {name!r}: nothing released")
    newer = None
    if RELEASING.match(name) is None:
        print("  checking for a newer verified-complete run (re-hashing its records)…", flush=True)
        newer = newer_verified_run(ws, name)
        print(f"  newer verified run: {newer.name} ({newer.records} records)" if newer
              else "  newer verified run: none")
    confirmed, newer_ok = None, False
    if args.confirm is not None:
        confirmed = name
    elif newer is not None and args.yes:
        newer_ok = True
    elif newer is not None and sys.stdin.isatty():
        newer_ok = (_ask(f"Delete run {name} and free {fmt_bytes(info.bytes)}? [y/N] ") or "").lower() in ("y", "yes")
    else:
        typed = _ask(f"Type the run name ({name}) to delete it, anything else keeps it: ")
        confirmed = name if typed == name else None
    if confirmed is None and not newer_ok:
        hint = ("answer y, or pass --yes in scripts (a newer run is verified)" if newer
                else f"type the run name, or pass --confirm {name} in scripts")
        print(f"not released: nothing deleted ({fmt_bytes(info.bytes)} would be freed); to release it, {hint}",
              file=sys.stderr)
        return 1
    freed = release_run(ws, name, confirmed_name=confirmed, newer_ok=newer_ok)
    print(f"released {name}: freed {fmt_bytes(freed)}")
    return 0


def _data_export(ws, args) -> int:
    from engine.system.disk import fmt_bytes
    from engine.release import output_dir_of
    from engine.specforge_export import ExportError, export_specforge

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty() and (done % 200 == 0 or done == total):
            print(f"\r  exported {done}/{total} records", end="\n" if done == total else "", file=sys.stderr,
                  flush=True)

    try:
        result = export_specforge(output_dir_of(ws), args.run, args.dir, progress=progress)
    except ExportError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"{exc.filename or args.dir}: {exc.strerror or exc}; nothing exported")
    print(f"exported run {result.run}: {result.files} records, {result.tokens} tokens, {fmt_bytes(result.bytes)} "
          f"to {result.dest} (SpecForge offline layout)")
    print(f"  train with SpecForge: data.hidden_states_path = {result.dest}; see "
          f"{result.dest}/eagle3_console_export.json for the layers the files hold")
    return 0
