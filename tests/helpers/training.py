"""Training tests' inputs: real records made in-process from a tiny target, and a workspace to
train on them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine import records
from engine.capture.layers import to_sglang_numbering
from engine.model.weights_id import weights_id
from engine.workspace import Workspace, init_workspace


def token_language(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    """Deterministic language over 40 tokens: next = perm[prev], with a fresh random start."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randperm(vocab - 10, generator=gen)[:40] + 5
    perm = torch.randperm(40, generator=gen)
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        i = int(torch.randint(0, 40, (1,), generator=rng))
        seq = []
        for _ in range(length):
            seq.append(int(tokens[i]))
            i = int(perm[i])
        out.append(seq)
    return out


def make_records(model_dir: Path, run_dir: Path, n: int = 24, length: int = 40, seed: int = 0) -> dict:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    layers = [1, num_layers // 2 - 1, num_layers - 4]
    layers = sorted(set(layers)) if len(set(layers)) == 3 else [0, 1, 2]
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab, dtype=torch.int64)
    with torch.no_grad():
        for index, seq in enumerate(token_language(seed, n, length, vocab)):
            ids = torch.tensor([seq])
            out = model.model(input_ids=ids, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)
            final = out.last_hidden_state[0]
            mask = torch.ones(length, dtype=torch.int64)
            mask[:4] = 0  # a short "prompt"
            entry = records.write_record(run_dir, index, f"s{index:04d}", ids[0], mask, aux, final)
            records.append_manifest(run_dir, entry)
            counts += torch.bincount(ids[0][mask.bool()], minlength=vocab)
    records.write_run_meta(run_dir, {"model": str(model_dir), "hidden_size": model.config.hidden_size,
                                     "layers": layers, "layers_sglang": to_sglang_numbering(layers),
                                     "num_samples": n, "dtype": "bfloat16", "model_weights": weights_id(model_dir)})
    records.save_token_counts(run_dir, counts)
    return {"layers": layers, "model": model}


def train_workspace(root: Path, model_dir: Path, hidden_run: Path, **train: Any) -> Workspace:
    """A workspace whose extraction output is `hidden_run`, with small training settings (`train`:
    train.* fields to change)."""
    ws = init_workspace(root)
    config = ws.config
    config.model.path = str(model_dir)
    config.extract.output_dir = str(hidden_run.parent)
    config.extract.run = hidden_run.name
    config.train.draft_vocab_size = 256
    config.train.learning_rate = 1e-2
    config.train.warmup_ratio = 0.05
    config.train.max_len = 40
    config.train.batch_size = 2
    config.train.ttt_steps = 3
    config.train.log_every = 5
    config.train.save_every = 10
    config.train.eval_fraction = 0.15
    config.train.epochs = 4
    for key, value in train.items():
        setattr(config.train, key, value)
    ws.save_config(config)
    return Workspace(root)
