"""The evaluation job (runs detached): `python -m engine.evaluate --workspace DIR [--limit N]`.

Loads the held-out prompts and the current drafter export, measures speculative decoding against
no speculation (local backend: in this process; sglang backend: two SGLang servers), and writes
`<eval_dir>/report.json` atomically with the export's identity. The final event (`finished`)
carries the rendered table, which `eagle3-console run evaluate` prints.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from engine.evaluate.report import (
    EXPORT_DIR,
    build_report,
    export_identity,
    render_table,
    target_identity,
    verdict,
    verdict_kind,
    write_report,
)
from engine.errors import EngineError


class JobError(EngineError):
    """Evaluation cannot run; the message names the cause and the fix."""


class Evaluation:
    def __init__(self, workspace: Any, ctx: Any = None, limit: int | None = None, launch: Any = None):
        """`launch`: the SGLang backend's server launcher (engine.evaluate.sglang_eval.Launch);
        None = supervised jobs running SGLang."""
        self.ws = workspace
        self.cfg = workspace.config
        self.ctx = ctx
        self.limit = limit
        self.launch = launch

    def event(self, kind: str, **data: Any) -> None:
        if self.ctx is not None:
            self.ctx.event(kind, **data)
        else:
            print(json.dumps({"type": kind, **data}, default=str), flush=True)

    def should_stop(self) -> bool:
        return bool(self.ctx is not None and self.ctx.stop_requested)

    @property
    def export_dir(self) -> Path:
        return self.ws.drafter_dir / EXPORT_DIR

    def _check_export(self) -> dict[str, Any]:
        from engine.train.export import check_export

        problems = check_export(self.export_dir)
        if problems:
            raise JobError(f"drafter export {self.export_dir} is not usable: {problems[0]}; run the train stage "
                           "(`eagle3-console run train`)")
        return export_identity(self.export_dir)

    def run(self) -> int:
        from engine.dataset.tokenize import load_tokenizer
        from engine.evaluate.prompts import load_prompts

        ev = self.cfg.evaluate
        identity = self._check_export()  # hashed before the run: a re-export during it is not credited
        target_id = target_identity(self.ws.model_dir)
        tokenizer = load_tokenizer(self.ws.model_dir)
        prompts, skipped = load_prompts(self.ws, tokenizer, self.limit, ev.max_new_tokens)
        backend = self.cfg.model.backend
        sweep: dict[str, Any] = ({"sglang_sweep": [list(x) for x in ev.sglang_sweep]} if backend == "sglang"
                                 else {"sweep_steps": list(ev.sweep_steps)})
        self.event("started", backend=backend, prompts=len(prompts), skipped=skipped, export=identity["path"],
                   sha256=identity["sha256"], rounds=ev.rounds, concurrency=list(ev.concurrency), **sweep)
        settings: dict[str, Any] = {
            "spec_steps": ev.spec_steps, "spec_topk": ev.spec_topk, "spec_draft_tokens": ev.spec_draft_tokens,
            "max_new_tokens": ev.max_new_tokens, "num_prompts": len(prompts), "skipped_prompts": skipped,
            "eval_path": self.cfg.dataset.eval_path, "rounds": ev.rounds, "concurrency": list(ev.concurrency), **sweep}
        started = time.monotonic()
        if backend == "sglang":
            results, notes, target, levels, load = self._run_sglang(prompts)
        else:
            results, notes, target, levels, load = self._run_local(prompts, tokenizer)
        if not results:
            self.event("stopped", done=0)
            return 0
        if len(results) < len(prompts):
            notes.append(f"stopped early: {len(results)} of {len(prompts)} prompts measured")
        if skipped:
            notes.append(f"{skipped} held-out sample(s) skipped (empty or too long)")
        report = build_report(backend=backend, drafter=identity, target={**target_id, **target}, settings=settings,
                              prompts=results, notes=notes, levels=levels, load=load)
        report["seconds"] = time.monotonic() - started
        path = write_report(self.ws.eval_dir, report)
        o = report["overall"]
        m = report.get("measurement") or {}
        self.event("finished", report=str(path), acceptance_length=o["acceptance_length"],
                   speedup=(m.get("speedup") or {}).get("median"), interval=(m.get("speedup") or {}).get("interval"),
                   verdict=verdict_kind(report), message=verdict(report), greedy_matches=o["greedy_matches"],
                   prompts=o["prompts"], table=render_table(report))
        return 0

    def _progress(self, unit: str) -> Callable[[dict[str, Any]], None]:
        """A progress event with the ETA from the rate so far, in `unit`."""
        started = time.monotonic()

        def progress(p: dict[str, Any]) -> None:
            done, total = p["done"], p["total"]
            elapsed = time.monotonic() - started
            eta = elapsed / done * (total - done) if done else None
            self.event("progress", unit=unit, eta_s=_round(eta, 1), **p)

        return progress

    def _run_local(self, prompts: list[Any], tokenizer: Any) -> tuple[Any, ...]:
        from engine.evaluate.local_eval import choose_cpu_threads, load_local, measure_local, precision_note

        ev = self.cfg.evaluate
        setup = load_local(self.ws, self.export_dir, tokenizer)
        notes = list(setup.notes)
        threads = choose_cpu_threads(setup.device)
        if threads:
            notes.append(threads)
        if ev.spec_topk != 1:
            notes.append(f"local backend drafts a chain (top-k 1); evaluate.spec_topk {ev.spec_topk} needs the "
                         "sglang backend")
        notes.append(f"local backend: {ev.spec_steps} draft tokens per verify step, KV caches on target and "
                     f"drafter, {setup.device} {setup.dtype}")
        notes.append(f"{ev.rounds} round(s); per round and request the baseline and every speculative setting run "
                     "back to back in an order that rotates, after an untimed warm-up; speedup = median over "
                     "prompts x rounds of per-request (spec tok/s / base tok/s), 95% bootstrap interval (seed 0)")
        notes.append("concurrency N on the local backend = N requests decoded together as one static batch "
                     "(per-row lengths, finished requests leave the batch; no continuous refill): throughput and "
                     "per-request latency; concurrency 1 uses the batch-1 decoders")
        self.event("loaded", device=setup.device, dtype=setup.dtype, hidden_state_indices=setup.aux_layers)
        progress = self._progress("requests x rounds")
        measured = measure_local(setup, prompts, ev.max_new_tokens, spec_steps=ev.spec_steps,
                                 sweep_steps=list(ev.sweep_steps), rounds=ev.rounds, levels=list(ev.concurrency),
                                 progress=progress, should_stop=self.should_stop)
        results = measured["prompt_results"]
        notes += measured["notes"]
        if measured["stopped"]:
            notes.append(f"stopped early: {measured['done']} of {measured['total']} requests x rounds measured")
        note = precision_note(setup.dtype, results)
        if note:
            notes.append(note)
        target = {"device": setup.device, "dtype": setup.dtype}
        return results, notes, target, measured["levels"], measured["load"]

    def _run_sglang(self, prompts: list[Any]) -> tuple[Any, ...]:
        import asyncio

        from engine.evaluate.sglang_eval import evaluate_sglang

        measured = asyncio.run(evaluate_sglang(
            self.ws, self.export_dir, prompts, progress=self._progress("requests x rounds x servers"),
            on_phase=lambda phase: self.event("phase", name=phase), should_stop=self.should_stop, launch=self.launch))
        notes = list(measured["notes"])
        if measured["stopped"]:
            notes.append(f"stopped early: {measured['done']} of {measured['total']} requests x rounds x servers "
                         "measured")
        return measured["prompt_results"], notes, {"server": "sglang"}, measured["levels"], measured["load"]


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from engine.config import ConfigError
    from engine.dataset.tokenize import TokenizerError
    from engine.evaluate.local_eval import EvalError
    from engine.evaluate.prompts import PromptError
    from engine.evaluate.sglang_eval import SglangEvalError
    from engine.evaluate.specdec import SpecDecodeError
    from engine.jobs.context import JobContext, say_error
    from engine.workspace import Workspace

    parser = argparse.ArgumentParser(prog="python -m engine.evaluate")
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N held-out prompts")
    args = parser.parse_args(argv)
    try:
        ctx = JobContext.from_env()
        ctx.install_sigterm_handler()
    except Exception:
        ctx = None  # run by hand: events go to stdout
    try:
        return Evaluation(Workspace(args.workspace), ctx, args.limit).run()
    except (ConfigError, TokenizerError, PromptError, EvalError, SglangEvalError, SpecDecodeError, JobError,
            OSError) as exc:
        return say_error(ctx, "evaluation", str(exc))
