"""Evaluation: real EAGLE-3 speculative decoding against the target, acceptance length and speedup.

  specdec      greedy speculative decoding and the greedy baseline (torch)
  local_eval   the local backend: target + drafter export in this process (torch)
  sglang_eval  the SGLang backend: two servers, with and without EAGLE-3 (argv + reply parsing)
  prompts      held-out prompts rendered with the chat template
  report       report.json, the drafter identity, and text rendering (no torch: the console reads it)
  job          `python -m engine.evaluate --workspace DIR`
"""
