"""Every /generate body the engine sends, parsed and verified by SGLang 0.5.23's own code.

SGLang's tokenizer manager turns the JSON into `GenerateReqInput`, calls
`normalize_batch_and_arguments()`, then builds `SamplingParams(**sampling_params)` and calls
`normalize(tokenizer)` and `verify(vocab_size)` before anything reaches the model; a field SGLang
does not know, or a value it refuses, is an HTTP 400 on the operator's box and nowhere else (our
local server reads the same names with its own parser). The bodies come from `engine.client.generate_body`,
the one builder every caller uses (extraction, the capture probe, regeneration, evaluation, the
server's stream bench).
"""

from __future__ import annotations

import json
import re

from sglang_judge.wheel import run_with_sglang

from engine.client import generate_body

VOCAB = 1000

JUDGE = '''
import json, sys
import native_stubs  # noqa: F401
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams

bodies, vocab = json.loads(sys.argv[1]), int(sys.argv[2])
seen = []
for body in bodies:
    try:
        request = GenerateReqInput(**body)
        request.normalize_batch_and_arguments()
        params = SamplingParams(**request.sampling_params)
        params.normalize(None)
        params.verify(vocab)
    except Exception as exc:  # what SGLang answers with HTTP 400
        seen.append({"refused": f"{type(exc).__name__}: {exc}"})
        continue
    seen.append({"rid": request.rid, "input_ids": request.input_ids, "text": request.text, "stream": request.stream,
                 "max_new_tokens": params.max_new_tokens, "greedy": params.top_k == 1,
                 "stop_token_ids": sorted(params.stop_token_ids or []), "seed": params.sampling_seed})
print("JUDGED " + json.dumps(seen))
'''


def _judge(importable, bodies):
    stdout = run_with_sglang(importable, JUDGE, json.dumps(bodies), str(VOCAB), timeout=180)
    line = next((ln for ln in stdout.splitlines() if ln.startswith("JUDGED ")), None)
    assert line, stdout[-3000:]
    return json.loads(line[len("JUDGED "):])


def test_sglang_accepts_every_body_we_send_and_reads_what_we_meant(sglang_importable):
    prompt = [5, 17, 301, 2]
    bodies = {
        "extraction (prefill only)": generate_body(prompt, max_new_tokens=0, rid="x3-abc123-a0"),
        "capture probe": generate_body(prompt, max_new_tokens=1, temperature=0.0, rid="probe-0123456789ab"),
        "regeneration": generate_body(prompt, max_new_tokens=64, temperature=0.0, stop_token_ids=[2, 7]),
        "evaluation": generate_body(prompt, max_new_tokens=256),
        "stream bench": generate_body(prompt, max_new_tokens=32, stream=True),
        "seeded": generate_body(prompt, max_new_tokens=8, temperature=0.7, seed=1234),
        "text": generate_body(text="hello", max_new_tokens=4),
        # The judge can refuse: a value SGLang rejects comes back refused, naming it.
        "refused": generate_body(prompt, max_new_tokens=-1),
    }
    judged = dict(zip(bodies, _judge(sglang_importable, list(bodies.values()))))
    assert "max_new_tokens must be at least 0" in judged.pop("refused")["refused"]
    refused = {name: seen["refused"] for name, seen in judged.items() if "refused" in seen}
    assert not refused, refused
    extraction, probe = judged["extraction (prefill only)"], judged["capture probe"]
    assert extraction["rid"] == "x3-abc123-a0" and extraction["input_ids"] == prompt
    assert extraction["max_new_tokens"] == 0 and extraction["greedy"]
    assert probe["rid"] == "probe-0123456789ab" and probe["max_new_tokens"] == 1 and probe["greedy"]
    assert judged["regeneration"]["stop_token_ids"] == [2, 7] and judged["regeneration"]["greedy"]
    assert judged["evaluation"]["max_new_tokens"] == 256 and judged["evaluation"]["greedy"]
    assert judged["stream bench"]["stream"] is True and judged["evaluation"]["stream"] is False
    assert judged["seeded"]["seed"] == 1234 and not judged["seeded"]["greedy"]
    assert judged["text"]["text"] == "hello" and judged["text"]["input_ids"] is None


# The reply's meta_info keys the engine reads from SGLang, and who reads them.
META_KEYS_READ = {
    "finish_reason": "engine/client.py (the finish kind), engine/dataset/regenerate.py",
    "prompt_tokens": "engine/extract/job.py and the capture probe: the server counted every token sent",
    "cached_tokens": "engine/extract/job.py and the capture probe: 0, or rows were never computed",
    "completion_tokens": "engine/server/bench.py, engine/evaluate/sglang_eval.py",
    "spec_verify_ct": "engine/evaluate/sglang_eval.py: acceptance = completion / verify steps",
    "spec_accept_length": "engine/evaluate/sglang_eval.py",
    "spec_correct_drafts_histogram": "engine/evaluate/sglang_eval.py: acceptance per draft position",
}


def _sets_meta_key(source: str, key: str) -> bool:
    return re.search(rf'(meta_info\[\s*"{key}"\s*\]\s*=|"{key}"\s*:)', source) is not None


def test_every_meta_info_key_we_read_is_one_sglang_sets(sglang_src):
    """SGLang 0.5.23's tokenizer manager builds the reply's meta_info: every key we read is set there
    (a renamed key would read as None and silently pass or fail a check). The 0.5.9 histogram name we
    still accept as a fallback is not set by 0.5.23, which shows the search can come back empty."""
    source = (sglang_src / "managers" / "tokenizer_manager.py").read_text(encoding="utf-8")
    missing = {key: reader for key, reader in META_KEYS_READ.items() if not _sets_meta_key(source, key)}
    assert not missing, missing
    assert not _sets_meta_key(source, "spec_accept_histogram")
