"""Forward hooks that record the captured states during a prefill.

Hooks on the chosen decoder layers (their output = pre-norm residual stream, HF
`hidden_states[i+1]`) and on the final norm (post-norm state that feeds the LM head), so the
states come from the very forward pass that produced the first token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.localserver.loading import ModelLoadError


class CaptureHooks:
    """Installed once; `set(True)` before a forward whose states are wanted, `set(False)` after."""

    def __init__(self) -> None:
        self._active = False
        self._store: dict[str, Any] = {}

    @property
    def active(self) -> bool:
        return self._active

    def install(self, model: Any, layers: list[int], num_layers: int, architectures: list[str]) -> None:
        """Hook `layers` (0-indexed) and the final norm; ModelLoadError if impossible."""
        from engine.capture.layers import validate_layers

        try:
            validate_layers(layers, num_layers)
        except ValueError as exc:
            raise ModelLoadError(f"capture: {exc}") from None
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        decoder_layers = getattr(decoder, "layers", None)
        norm = next((getattr(decoder, name) for name in ("norm", "final_layernorm", "ln_f")
                     if getattr(decoder, name, None) is not None), None)
        if decoder_layers is None or norm is None:
            raise ModelLoadError(
                "capture needs a decoder with .layers and a final norm; this architecture "
                f"({', '.join(architectures) or 'unknown'}) does not expose them"
            )
        for layer_id in layers:
            decoder_layers[layer_id].register_forward_hook(self._make_hook(f"layer{layer_id}"))
        norm.register_forward_hook(self._make_hook("final"))

    def set(self, active: bool) -> dict[str, Any]:
        """Turn the hooks on or off; returns the (emptied) store they fill: hook key -> [B, W, H]."""
        self._active = active
        self._store = {}
        return self._store

    def _make_hook(self, key: str) -> Callable:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            if self._active:
                self._store[key] = output[0] if isinstance(output, tuple) else output
        return hook
