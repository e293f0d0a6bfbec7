"""Which decoder layers EAGLE-3 captures, and the two numberings in use.

Our numbering ("layer i") is 0-indexed and means *the output of decoder layer i*
(= HF `hidden_states[i + 1]`, pre final norm). SGLang's `layers_to_capture` index j means
*the input of layer j*, i.e. the output of layer j-1, so SGLang's id = ours + 1.
Showing both numberings matters: mixing them up captures the wrong layers silently.

The last decoder layer's output cannot be an aux state in SGLang (the capture runs before
a layer and there is no iteration after the last one), so valid ids are 0 .. L-2; the
post-norm final state is stored separately as `hidden_state`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

NUM_CAPTURE_LAYERS = 3


def default_capture_layers(num_layers: int) -> list[int]:
    """Default EAGLE-3 layers for a target with `num_layers` decoder layers.

    SGLang/SpecForge default: outputs of layers [1, L//2-1, L-4]. That formula collides or
    goes negative for L < 7 (L=4 gives [1, 1, 0]); tiny models then get three distinct ids
    spread evenly over 0 .. L-2 (L=4 -> [0, 1, 2], L=6 -> [0, 2, 4]). Fewer than 4 layers
    cannot give three distinct capturable layers and raises ValueError.
    """
    if not isinstance(num_layers, int) or num_layers < NUM_CAPTURE_LAYERS + 1:
        raise ValueError(
            f"a target with {num_layers} decoder layers is too small for EAGLE-3 capture: "
            f"need at least {NUM_CAPTURE_LAYERS + 1} layers (3 distinct layers, excluding the last)"
        )
    formula = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(formula)) == NUM_CAPTURE_LAYERS and min(formula) >= 0:
        return sorted(formula)
    top = num_layers - 2
    return [round(k * top / (NUM_CAPTURE_LAYERS - 1)) for k in range(NUM_CAPTURE_LAYERS)]


def to_sglang_numbering(layers: Iterable[int]) -> list[int]:
    """Our 'output of layer i' ids -> SGLang `layers_to_capture` ids ('input of layer i+1')."""
    return [int(layer) + 1 for layer in layers]


def from_sglang_numbering(layers: Iterable[int]) -> list[int]:
    """SGLang `layers_to_capture` ids -> our 'output of layer i' ids."""
    return [int(layer) - 1 for layer in layers]


def validate_layers(
    layers: Sequence[int], num_layers: int, expected_count: int | None = NUM_CAPTURE_LAYERS
) -> list[int]:
    """Return `layers` as a list if valid for a target with `num_layers` layers, else ValueError.

    Valid: integers in 0 .. num_layers-2 (0-indexed layer outputs), strictly increasing,
    and `expected_count` of them (3 for EAGLE-3; None skips the count check).
    """
    last_valid = num_layers - 2
    valid_range = f"0..{last_valid} (0-indexed decoder-layer outputs of a {num_layers}-layer model)"
    result: list[int] = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"capture layer {layer!r} is not an integer; valid range is {valid_range}")
        if layer < 0 or layer > last_valid:
            hint = ""
            if layer == num_layers - 1:
                hint = " (the last layer's output is the final hidden state, stored separately)"
            elif layer == num_layers:
                hint = " (is this SGLang's layers_to_capture? ours is that minus 1)"
            raise ValueError(f"capture layer {layer} is out of range{hint}; valid range is {valid_range}")
        result.append(layer)
    if expected_count is not None and len(result) != expected_count:
        raise ValueError(f"expected {expected_count} capture layers, got {len(result)}: {result}")
    if not result:
        raise ValueError("no capture layers given")
    for low, high in zip(result, result[1:]):
        if high <= low:
            raise ValueError(
                f"capture layers must be distinct and increasing (low -> high), got {result}"
            )
    return result


def parse_layer_list(text: str) -> list[int]:
    """Parse '1,3,4' into [1, 3, 4]; ValueError naming the bad item."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"empty capture layer list {text!r}; expected e.g. '1,3,4'")
    parsed: list[int] = []
    for item in items:
        try:
            parsed.append(int(item))
        except ValueError:
            raise ValueError(f"capture layer {item!r} in {text!r} is not an integer") from None
    return parsed
