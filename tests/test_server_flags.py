"""The server's flags as the watcher reports them and the Server pane shows them."""

from __future__ import annotations

from eagle3_console.panes.server import flags_text
from engine.server.manager import server_flags


def test_prefill_graphs_summarised_in_one_word():
    info = {"disable_radix_cache": True, "unrelated": 1,
            "prefill_cuda_graphs": {"enabled": True, "max_tokens": 8192, "failure": None,
                                    "buckets": ["1x512", "8x512"]}}
    flags = server_flags(info)
    assert flags == {"disable_radix_cache": True, "prefill_graphs": "on (2 buckets)"}
    assert list(flags)[0] == "prefill_graphs"  # shown first: the pane clips the flags line
    info["prefill_cuda_graphs"] = {"enabled": False, "failure": "capture of 8x512 failed: out of memory"}
    assert server_flags(info)["prefill_graphs"] == "failed"
    info["prefill_cuda_graphs"] = {"enabled": False}
    assert server_flags(info)["prefill_graphs"] == "off"
    del info["prefill_cuda_graphs"]  # SGLang's /server_info has no such key
    assert "prefill_graphs" not in server_flags(info)


def test_failed_graphs_shown_as_a_warning_and_radix_cache_as_an_error():
    text = flags_text({"disable_radix_cache": False, "prefill_graphs": "failed"}, 120)
    assert "[$error]radix cache ON[/]" in text
    assert "[$warning]prefill graphs failed (eager)[/]" in text
    assert "prefill_graphs=" not in text
    assert "prefill_graphs=[/]on (4 buckets)" in flags_text({"prefill_graphs": "on (4 buckets)"}, 120)


def test_capture_writer_in_one_word_and_its_fallback_as_a_warning():
    info = {"capture": {"enabled": True, "writer": "process (pid 4242)"}}
    assert server_flags(info) == {"capture_writer": "process"}
    info["capture"]["writer"] = "threads (4)"
    assert server_flags(info) == {"capture_writer": "threads"}
    info["capture"]["writer"] = "threads (4); the capture writer process exited (code -9) with 0 batch(es) unwritten"
    assert server_flags(info) == {"capture_writer": "process stopped"}
    assert "[$warning]writer process stopped (threads)[/]" in flags_text(server_flags(info), 120)
    info.update(disable_radix_cache=True, tp_size=1)
    assert list(server_flags(info)) == ["capture_writer", "disable_radix_cache", "tp_size"]  # the warning first
    info["capture"]["writer"] = "threads (4)"
    assert list(server_flags(info)) == ["disable_radix_cache", "tp_size", "capture_writer"]  # else last
    assert "capture_writer" not in server_flags({"capture": {"enabled": False, "writer": None}})
    assert "capture_writer" not in server_flags({"capture": "unexpected"})
