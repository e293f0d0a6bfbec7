"""Prefill CUDA graphs of the local server: the bucketing, the environment switch, and the forward a
graph holds. CUDA graphs cannot exist on CPU, so here the graph's forward (decoder only, explicit
[B, 1, L, L] mask, no cache) runs eagerly on a real tiny Llama and must capture the same states as the
server's own padded forward; capture and replay are tested on the GPU box by
tests/test_localserver.py::test_cuda_capture_of_a_mixed_batch_equals_the_reference[cuda-graphs]."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.localserver.capture_sink import CaptureConfig
from engine.localserver.model_runner import ModelRunner
from engine.localserver.prefill_graphs import (
    DEFAULT_MAX_TOKENS,
    PrefillGraphs,
    bucket_for,
    graph_token_limit,
    padding_mask,
)


def test_buckets_round_rows_to_powers_of_two_and_tokens_to_128():
    assert bucket_for(1, 1, 8, 8192) == (1, 128)
    assert bucket_for(3, 129, 8, 8192) == (4, 256)
    assert bucket_for(5, 512, 8, 8192) == (8, 512)
    assert bucket_for(6, 500, 6, 8192) == (6, 512)  # never more rows than the server batches
    assert bucket_for(8, 1025, 8, 8192) is None  # 8 x 1152 tokens: large enough to run eagerly
    assert bucket_for(9, 10, 8, 8192) is None and bucket_for(0, 10, 8, 8192) is None
    assert bucket_for(2, 64, 8, 0) is None


def test_token_limit_comes_from_the_environment(monkeypatch, capsys):
    monkeypatch.delenv("EAGLE3_PREFILL_GRAPH_TOKENS", raising=False)
    assert graph_token_limit() == DEFAULT_MAX_TOKENS
    monkeypatch.setenv("EAGLE3_PREFILL_GRAPH_TOKENS", "0")
    assert graph_token_limit() == 0
    monkeypatch.setenv("EAGLE3_PREFILL_GRAPH_TOKENS", "lots")
    assert graph_token_limit() == DEFAULT_MAX_TOKENS
    assert "EAGLE3_PREFILL_GRAPH_TOKENS='lots' is not a whole number" in capsys.readouterr().err


def test_padding_mask_is_causal_and_hides_padded_keys():
    mask = padding_mask(torch, torch.tensor([3, 1]), 4)
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.bool
    assert mask[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                   [True, True, True, False], [True, True, True, False]]
    assert mask[1, 0].tolist() == [[True, False, False, False]] * 4  # padded queries see the real token


def test_graph_forward_captures_what_the_eager_server_forward_captures(tiny_model_dir: Path, tmp_path: Path):
    """Mixed lengths, padded into a bigger bucket (4 rows x 128 tokens for 3 rows of at most 11): the
    hook states of the real positions must equal those of the server's eager padded forward (fp32; other
    shapes, other summation order: 1e-4, where a wrong mask is off by whole units)."""
    runner = ModelRunner(tiny_model_dir, device="cpu", dtype="float32",
                         capture=CaptureConfig(layers=[0, 1, 2], spool_dir=tmp_path / "spool"))
    runner.load()
    assert runner.prefill_graphs is None  # graphs are for CUDA only
    lengths = [11, 4, 7]
    rows, width = len(lengths), max(lengths)
    ids = torch.full((rows, width), runner.info.pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, runner.info.vocab_size, (n,), generator=generator)
        mask[row, :n] = 1
    with torch.inference_mode():
        store = runner.hooks.set(True)
        runner._forward(ids, mask, torch.arange(width).expand(rows, -1), None)
        eager = dict(store)
        graphs = PrefillGraphs(runner.model.get_decoder(), "cpu", 4, runner.info.pad_token_id, runner.hooks.set,
                               max_tokens=8192)
        shape = bucket_for(rows, width, 4, 8192)
        assert shape == (4, 128)
        padded = torch.full(shape, runner.info.pad_token_id, dtype=torch.long)
        padded[:rows, :width] = ids
        store = runner.hooks.set(True)
        graphs.forward_static(padded, torch.tensor(lengths + [1]))
        static = dict(store)
        runner.hooks.set(False)
    assert set(static) == set(eager) == {"layer0", "layer1", "layer2", "final"}
    for key in eager:
        for row, n in enumerate(lengths):
            torch.testing.assert_close(static[key][row, :n], eager[key][row, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("captured", [[0, 1, 2], [0, 2]], ids=["all-rows", "some-rows"])
def test_batch_captures_hand_each_row_its_own_real_positions(tiny_model_dir: Path, tmp_path: Path, captured):
    """The graph path queues one buffer per batch and gives every captured row views of it: each
    written segment must hold exactly that row's real positions of the padded bucket's states (not
    the padding, not a neighbour's), through safetensors, for all rows and for a subset. On CPU the
    buffers are the concatenated states; on CUDA they are pinned copies (the GPU box's server test)."""
    from types import SimpleNamespace

    from engine.capture.segments import assemble, write_segment

    spool = tmp_path / "spool"
    runner = ModelRunner(tiny_model_dir, device="cpu", dtype="float32",
                         capture=CaptureConfig(layers=[0, 1, 2], spool_dir=spool))
    runner.load()
    lengths = [11, 4, 7]
    generator = torch.Generator().manual_seed(1)
    padded = torch.full((4, 128), runner.info.pad_token_id, dtype=torch.long)
    for row, n in enumerate(lengths):
        padded[row, :n] = torch.randint(3, runner.info.vocab_size, (n,), generator=generator)
    host_ids = padded[:3, :max(lengths)].clone()
    with torch.inference_mode():
        graphs = PrefillGraphs(runner.model.get_decoder(), "cpu", 4, runner.info.pad_token_id, runner.hooks.set,
                               max_tokens=8192)
        store = runner.hooks.set(True)
        graphs.forward_static(padded, torch.tensor(lengths + [1]))
        states = dict(store)
        runner.hooks.set(False)
        completions = [SimpleNamespace(capture_queued=False, rid=f"row-{row}") for row in range(3)]
        runner.sink.queue_batch(completions, captured, lengths, host_ids, states)
    queued = [runner.sink._write_queue.get_nowait() for _ in captured]
    assert runner.sink._write_queue.empty()
    assert [item[0].rid for item in queued] == [f"row-{row}" for row in captured]
    assert all(completions[row].capture_queued for row in captured)
    for (completion, ids, aux, final, copied), row in zip(queued, captured):
        n = lengths[row]
        assert copied is None and ids.tolist() == padded[row, :n].tolist()
        write_segment(spool, completion.rid, 0, ids, aux, final, [0, 1, 2])
        segment = assemble(spool, completion.rid, expected_len=n, expected_input_ids=padded[row, :n].tolist())
        expected_aux = torch.cat([states[f"layer{layer}"][row, :n] for layer in (0, 1, 2)], dim=-1)
        assert torch.equal(segment.aux_hidden_state, expected_aux)
        assert torch.equal(segment.hidden_state, states["final"][row, :n])


def test_graphs_stay_off_on_cpu_and_when_disabled(tiny_model_dir: Path):
    decoder = torch.nn.Identity()
    assert PrefillGraphs(decoder, "cpu", 8, 0, lambda active: {}, max_tokens=8192).bucket(2, 10) is None
    off = PrefillGraphs(decoder, "cuda:0", 8, 0, lambda active: {}, max_tokens=0)
    assert off.bucket(2, 10) is None and off.describe() == {"enabled": False, "max_tokens": 0, "failure": None,
                                                             "buckets": []}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU box)")
def test_cuda_graph_replay_equals_eager_for_new_inputs(tiny_model_dir: Path, tmp_path: Path):
    """A bucket captured once must give, for other ids and lengths, the states an eager forward of those
    inputs gives (a graph that replayed stale inputs or outputs would not)."""
    runner = ModelRunner(tiny_model_dir, device="cuda", dtype="float32",
                         capture=CaptureConfig(layers=[0, 1, 2], spool_dir=tmp_path / "spool"))
    runner.load()
    graphs = runner.prefill_graphs
    generator = torch.Generator().manual_seed(1)
    for lengths in ([9, 30, 17], [30, 2, 25], [5, 5, 5]):  # all in the 4 x 128 bucket
        rows, width = len(lengths), max(lengths)
        ids = torch.full((rows, width), runner.info.pad_token_id, dtype=torch.long)
        for row, n in enumerate(lengths):
            ids[row, :n] = torch.randint(3, runner.info.vocab_size, (n,), generator=generator)
        with torch.inference_mode():
            states = {key: value.clone() for key, value in graphs.run(ids, lengths).items()}
            for row, n in enumerate(lengths):
                store = runner.hooks.set(True)
                runner._forward(ids[row:row + 1, :n].cuda(), torch.ones((1, n), dtype=torch.long, device="cuda"),
                                torch.arange(n, device="cuda").unsqueeze(0), None)
                for key, value in store.items():
                    torch.testing.assert_close(states[key][row, :n], value[0], atol=1e-4, rtol=1e-4)
                runner.hooks.set(False)
    assert graphs.describe()["buckets"] == ["4x128"] and graphs.failure is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where a CUDA capture cannot work")
def test_a_failed_capture_turns_graphs_off_and_the_batch_runs_eagerly(capsys):
    """The fallback, for real: on a CPU-only torch the capture of the first bucket fails; `run` must say
    so once on stderr, return None (the caller then runs the batch eagerly) and stay off afterwards."""
    calls = []
    graphs = PrefillGraphs(torch.nn.Identity(), "cuda:0", 8, 0, lambda active: calls.append(active) or {},
                           max_tokens=8192)
    ids = torch.ones((2, 10), dtype=torch.long)
    assert graphs.bucket(2, 10) == (2, 128)
    assert graphs.run(ids, [10, 4]) is None
    assert graphs.enabled is False and graphs.failure and calls[-1] is False
    assert "prefill CUDA graphs off, running eagerly: capture of bucket (2, 128) failed" in capsys.readouterr().err
    assert graphs.run(ids, [10, 4]) is None and graphs.describe()["buckets"] == []
    assert capsys.readouterr().err == ""  # said once
