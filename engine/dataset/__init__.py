"""Chat datasets: parsing (formats), tokenising with the target's template (tokenize),
statistics (stats) and regeneration of assistant turns by the target (regenerate)."""

from engine.dataset.formats import (
    BadLine,
    BadLineError,
    DatasetError,
    DatasetReader,
    LineTooLongError,
    ParseReport,
    Sample,
    iter_samples,
)
from engine.dataset.tokenize import (
    TokenizedSample,
    TokenizerError,
    load_tokenizer,
    mask_method,
    tokenize_batch,
    tokenize_conversation,
)

__all__ = [
    "BadLine", "BadLineError", "DatasetError", "DatasetReader", "LineTooLongError", "ParseReport", "Sample", "iter_samples",
    "TokenizedSample", "TokenizerError", "load_tokenizer", "mask_method", "tokenize_batch",
    "tokenize_conversation",
]
