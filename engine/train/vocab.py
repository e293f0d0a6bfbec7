"""Draft vocabulary: the most frequent loss-masked target tokens.

`d2t[i]` is an offset: target id = i + d2t[i] (what SGLang's loader turns into hot_token_id);
`t2d` is a bool mask over the target vocabulary. Draft ids are target ids in ascending order,
so `arange + d2t` is strictly increasing and equals `nonzero(t2d)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from engine.errors import EngineError


class VocabError(EngineError, ValueError):
    pass


@dataclass(frozen=True)
class DraftVocab:
    d2t: torch.Tensor  # int64 [draft]
    t2d: torch.Tensor  # bool [target]
    coverage: float  # fraction of loss-masked target tokens the draft vocabulary covers

    @property
    def hot_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.shape[0], dtype=torch.int64)

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids (-1 where the token is not in the draft vocabulary)."""
        table = torch.full((self.t2d.shape[0],), -1, dtype=torch.int64, device=target_ids.device)
        table[self.hot_ids.to(target_ids.device)] = torch.arange(self.d2t.shape[0], device=target_ids.device)
        return table[target_ids]


def draft_vocab_size(configured: int, target_vocab: int) -> int:
    return min(int(configured), int(target_vocab))


def build_vocab(counts: torch.Tensor, size: int) -> DraftVocab:
    """Top-`size` tokens by count (ties broken by lower id); unseen ids fill up if too few were seen."""
    counts = counts.to(torch.int64).flatten()
    vocab = counts.shape[0]
    if size > vocab:
        raise VocabError(f"draft vocabulary {size} is larger than the target vocabulary {vocab}")
    # Stable order: by count descending, then id ascending.
    order = torch.argsort(-counts, stable=True)
    chosen = torch.sort(order[:size]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(size, dtype=torch.int64)
    total = int(counts.sum())
    coverage = float(counts[chosen].sum()) / total if total else 0.0
    return DraftVocab(d2t, t2d, coverage)


def validate_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """The checks that catch the known d2t/t2d mistakes (offset vs absolute, misaligned rows)."""
    size = d2t.shape[0]
    hot = d2t.to(torch.int64) + torch.arange(size)
    if int(t2d.sum()) != size:
        raise VocabError(f"t2d marks {int(t2d.sum())} tokens, d2t has {size}")
    if size > 1 and not bool((hot[1:] > hot[:-1]).all()):
        raise VocabError("arange + d2t is not strictly increasing (is d2t absolute instead of an offset?)")
    if int(hot.min()) < 0 or int(hot.max()) >= t2d.shape[0]:
        raise VocabError("d2t maps outside the target vocabulary")
    if not torch.equal(hot, torch.nonzero(t2d).flatten()):
        raise VocabError("arange + d2t differs from the tokens t2d marks")
