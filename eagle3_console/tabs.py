"""The console's tabs, in number-key order. No Textual import: the headless CLI reads them too."""

from __future__ import annotations

# (tab id, tab label); the number keys follow this order.
TABS: list[tuple[str, str]] = [
    ("gpus", "GPUs"),
    ("server", "Server"),
    ("pipeline", "Pipeline"),
    ("extraction", "Extraction"),
    ("training", "Training"),
    ("evaluation", "Evaluation"),
    ("jobs", "Jobs"),
]
TAB_IDS = tuple(tab for tab, _label in TABS)
