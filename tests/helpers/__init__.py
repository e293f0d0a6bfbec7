"""The one home of helpers shared by test modules (test modules never import each other).

- models: the tiny real Llama + BPE tokenizer (the `tiny_model_dir` fixture builds it) and a
  config-only model directory.
- workspaces: real workspaces on a loadable model or on a config-only one; conversations.
- training: records made in-process from a tiny target, and a workspace that trains on them.
- drafters: a random EAGLE-3 drafter over a target, and the training forward chains must match.
- processes: free ports, the local server's command line and health wait, a second lock holder.
- jobs: real detached jobs in a known state; events: a job event of any kind, every field filled.
- screen: what a Textual app shows as text, and waiting for it under Pilot.
- scenes: deterministic console scenes for snapshots and screenshots.

Fixtures stay in conftest.py; anything a test module imports comes from here (the fault suite's
own helpers are its package's modules: tests/faults/helpers.py, console.py, ledger.py, zygote.py).
tests/test_helpers_home.py fails when a test module imports another one or a conftest.
"""
