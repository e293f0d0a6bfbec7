"""Stage `capture`: the probe. One real request with capture on, checked end to end.

Pass only if tokens captured = tokens sent, cached_tokens = 0, shapes [T, 3H] and [T, H],
every value finite, and the target's LM head over the last captured final state picks the
token the server itself generates next. Each failure names its cause.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext
from engine.checks.server import START_FIX, probe_prompt_ids, settings_check

if TYPE_CHECKING:
    from engine.client import GenerateResult


def _analyse(spool_dir: Path, rid: str, sent: list[int], model_dir: Path, server_next: int,
             wait_s: float) -> list[CheckResult]:
    import torch

    from engine.capture.segments import CaptureIncomplete, CaptureLost, SegmentError, assemble
    from engine.model.target import text_config
    from engine.model.lmhead import LmHeadError, load_lm_head

    hidden = int(text_config(model_dir)["hidden_size"])
    try:
        try:  # the whole prompt, once the server's writer has written it (SGLang answers first)
            cap = assemble(spool_dir, rid, len(sent), wait_s=wait_s)
        except CaptureIncomplete as waited:
            try:
                cap = assemble(spool_dir, rid)  # what there is, for the checks below to name
            except CaptureIncomplete:
                raise waited from None
    except CaptureLost as exc:
        return [failed("tokens", f"no usable capture for rid {rid}: {exc}",
                       "the server's capture writer failed after answering: fix what the reason names (often a "
                       "full spool disk, see the server log), then run the check again")]
    except (SegmentError, FileNotFoundError, OSError) as exc:
        return [failed("tokens", f"no usable capture for rid {rid}: {exc}",
                       "the server did not write segments: check it was started with capture on (server stage)")]
    results = []
    got = int(cap.input_ids.shape[0])
    same_ids = got == len(sent) and cap.input_ids.tolist() == sent
    if got != len(sent):
        results.append(failed("tokens", f"sent {len(sent)} tokens, captured {got}",
                              "a prefix cache or chunking is dropping rows: radix cache must be off"))
    elif not same_ids:
        results.append(failed("tokens", f"captured {got} tokens but the ids differ from those sent",
                              "segments were stitched out of order or belong to another request"))
    else:
        results.append(passed("tokens", f"sent {len(sent)} = captured {got}"))
    aux_shape, fin_shape = tuple(cap.aux_hidden_state.shape), tuple(cap.hidden_state.shape)
    if aux_shape != (got, 3 * hidden) or fin_shape != (got, hidden):
        results.append(failed("shapes", f"aux {list(aux_shape)}, final {list(fin_shape)}; expected "
                                        f"[{got}, {3 * hidden}] and [{got}, {hidden}]",
                              "capture layers or hidden size mismatch between server and model config"))
        return results
    results.append(passed("shapes", f"aux [{got}, {3 * hidden}] ({cap.aux_hidden_state.dtype}), final [{got}, {hidden}]"))
    bad = int((~torch.isfinite(cap.aux_hidden_state.float())).sum() + (~torch.isfinite(cap.hidden_state.float())).sum())
    if bad:
        results.append(failed("finite", f"{bad} non-finite values (NaN/Inf) in the captured states",
                              "numerical trouble in the target: check dtype and attention backend"))
    else:
        results.append(passed("finite", f"all {cap.aux_hidden_state.numel() + cap.hidden_state.numel():,} values finite"))
    try:
        head = load_lm_head(model_dir)
    except LmHeadError as exc:
        results.append(failed("argmax", str(exc), "the teacher needs the target's LM head"))
        return results
    logits = cap.hidden_state[-1].float() @ head.float().T
    ours = int(torch.argmax(logits))
    if ours != server_next:
        results.append(failed("argmax", f"LM head over the captured final state picks token {ours}, "
                                        f"the server generated {server_next}",
                              "the captured final state is not the one feeding the LM head (wrong norm/layer or "
                              "per-rank partial sums: turn all-reduce fusion off)"))
    else:
        results.append(passed("argmax", f"LM head(captured final state) = server's next token {server_next}"))
    return results


async def check_capture(ctx: CheckContext) -> list[CheckResult]:
    from engine.server.manager import ServerManager

    manager = ServerManager(ctx.workspace)
    status = await manager.poll()
    if status.state != "ready":
        return [failed("server", f"server {status.state}", START_FIX)]
    # The probe below captures with the server's own settings: it says whether capture works, not
    # whether it captures what console.toml describes (another spool, layers or model).
    settings = [settings_check(list(status.drift))] if status.drift else []
    spool = Path(manager.record().get("spool_dir") or ctx.workspace.spool_dir)
    sent = await asyncio.to_thread(probe_prompt_ids, ctx.workspace)
    rid = f"probe-{uuid.uuid4().hex[:12]}"
    client = manager.client()
    try:
        result = await client.generate(input_ids=sent, max_new_tokens=1, temperature=0.0, rid=rid)
    except Exception as exc:
        return settings + [failed("request", f"probe request failed: {exc}", "see `eagle3-console server logs`")]
    finally:
        await client.aclose()
    try:
        results = await _judge(ctx, spool, rid, sent, result, list(settings))
    finally:
        released = await asyncio.to_thread(_release_probe, spool, rid)
    return results + ([released] if released else [])


def _release_probe(spool: Path, rid: str) -> CheckResult | None:
    """Free the probe's spool folder; a folder we may not empty is said, never raised: raising here
    would replace the verdict above with a crashed check."""
    from engine.capture.segments import SegmentError, release

    try:
        release(spool, rid)
    except (SegmentError, OSError) as exc:
        return warned("spool", f"the probe's spool folder was left in place: {exc}",
                      f"remove what is not a capture segment from {spool / rid}")
    return None


async def _judge(ctx: CheckContext, spool: Path, rid: str, sent: list[int], result: GenerateResult,
                 results: list[CheckResult]) -> list[CheckResult]:
    """The probe's reply and capture against what was sent and what the model computes."""
    meta = result.meta
    cached = meta.get("cached_tokens")
    if cached != 0:
        results.append(failed("cached", f"cached_tokens = {cached}", "disable the radix cache (--disable-radix-cache)"))
    else:
        results.append(passed("cached", "cached_tokens = 0"))
    if meta.get("prompt_tokens") != len(sent):
        results.append(failed("prompt", f"server counted {meta.get('prompt_tokens')} prompt tokens, sent {len(sent)}",
                              "the server re-tokenised or truncated the prompt"))
    if not result.output_ids:
        return results + [failed("request", "server generated no token", "check the server log")]
    return results + await asyncio.to_thread(_analyse, spool, rid, sent, ctx.workspace.model_dir,
                                             int(result.output_ids[0]), ctx.config.extract.capture_wait_s)
