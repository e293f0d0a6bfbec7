"""Hidden-state capture: layer choice (`layers`, torch-free) and the spool segment format
shared by all backends (`segments`, imports torch: import it explicitly where needed so the
UI's start-up never pulls torch in)."""

from engine.capture.layers import (
    default_capture_layers,
    from_sglang_numbering,
    parse_layer_list,
    to_sglang_numbering,
    validate_layers,
)

__all__ = [
    "default_capture_layers",
    "from_sglang_numbering",
    "parse_layer_list",
    "to_sglang_numbering",
    "validate_layers",
]
