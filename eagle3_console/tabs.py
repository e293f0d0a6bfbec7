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
# Below SHORT_TABS_BELOW columns the tab bar uses these, so all seven tabs fit in 60 columns.
SHORT_LABELS = {"gpus": "GPU", "server": "Srv", "pipeline": "Pipe", "extraction": "Extr", "training": "Train",
                "evaluation": "Eval", "jobs": "Jobs"}
SHORT_TABS_BELOW = 80
