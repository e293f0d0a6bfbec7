"""Drafters for evaluation tests: a randomly initialised EAGLE-3 drafter over a target, and the
training-time forward a decoding chain must reproduce."""

from __future__ import annotations

import torch

from engine.evaluate.specdec import aux_features
from engine.train.model import DraftConfig, Eagle3Drafter

AUX = [1, 2, 3]  # SGLang ids for a 4-layer target = outputs of layers 0, 1, 2


def make_drafter(target, draft_vocab: int = 200, seed: int = 0, hot_ids=None) -> Eagle3Drafter:
    cfg = target.config
    dcfg = DraftConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
                       vocab_size=cfg.vocab_size, draft_vocab_size=draft_vocab, rms_norm_eps=cfg.rms_norm_eps,
                       aux_layers_sglang=AUX)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(dcfg)
    if hot_ids is None:  # an uneven subset, so d2t offsets are not all equal
        hot_ids = torch.sort(torch.randperm(cfg.vocab_size)[:draft_vocab]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[hot_ids] = True
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        for name, param in drafter.named_parameters():
            if param.dim() > 1 and name != "embed_tokens.weight":
                param.normal_(0.0, 0.2)
        drafter.set_vocab(hot_ids - torch.arange(draft_vocab), t2d)
    return drafter.eval()


CHAIN_IDS = [[7, 19, 33, 2, 150, 61, 8, 90, 12, 250, 44, 5, 71, 3]]


def training_attention_reference(target, drafter, steps: int = 3):
    """(ids, target aux features, Eagle3Drafter.draft_logits: the TTT forward a chain must reproduce)."""
    ids = torch.tensor(CHAIN_IDS)
    with torch.no_grad():
        aux = aux_features(target(input_ids=ids, output_hidden_states=True).hidden_states, AUX)
        return ids, aux, drafter.draft_logits(ids, aux, steps=steps)


# A drafter small enough for float64 gradient checks of the training step.
TINY_TRAIN_CFG = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                      vocab_size=90, draft_vocab_size=40, rms_norm_eps=1e-5)


def tiny_training_drafter(dtype: torch.dtype = torch.float32, seed: int = 0) -> Eagle3Drafter:
    """TINY_TRAIN_CFG's drafter with weights far from their defaults: a norm weight of ones would hide a
    wrong norm-weight gradient."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(DraftConfig(**TINY_TRAIN_CFG))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.to(dtype)


def tiny_drafter(seed: int = 0) -> Eagle3Drafter:
    """tiny_training_drafter with the embedding in bf16, as place_drafter holds it on the GPU."""
    model = tiny_training_drafter(seed=seed)
    model.embed_tokens.to(torch.bfloat16)
    return model


def ttt_inputs(t: int = 24, seed: int = 1):
    """One bf16 record for TINY_TRAIN_CFG and a teacher for it: (Batch, TeacherOut)."""
    from engine.train.data import Batch, TeacherOut

    gen = torch.Generator().manual_seed(seed)
    h, vd = TINY_TRAIN_CFG["hidden_size"], TINY_TRAIN_CFG["draft_vocab_size"]
    ids = torch.randint(0, TINY_TRAIN_CFG["vocab_size"], (1, t), generator=gen)
    aux = torch.randn(1, t, 3 * h, generator=gen).to(torch.bfloat16)
    batch = Batch(ids, torch.ones(1, t, dtype=torch.bool), aux, torch.zeros(1, t, h, dtype=torch.bfloat16),
                  torch.tensor([t]))
    probs = torch.softmax(2.0 * torch.randn(1, t, vd, generator=gen), -1).to(torch.bfloat16)
    teacher = TeacherOut(probs, torch.randint(-1, vd, (1, t), generator=gen), torch.ones(1, t, dtype=torch.bool))
    return batch, teacher
