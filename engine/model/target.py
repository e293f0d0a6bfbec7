"""The target plan: the target model's `config.json`, read once, and every layer number derived from it.

Nothing else in the engine reads a target's `config.json` or computes layer numbers: the launch
argv, the local server, extraction, checks, training, the export and evaluation all take a
`TargetPlan`. Three numberings exist, and each appears in one place only:

- ours ("capture layer i"): the output of decoder layer i, 0-indexed. console.toml, the records'
  `run.json`, the console and the local server use it.
- SGLang's `layers_to_capture` (inside the model): index j captures the *input* of layer j, i.e.
  the output of layer j-1. So it is always ours + 1, for every architecture.
- SGLang's *layer ids* (`--return-aux-hidden-state-layer-ids` and the export's
  `eagle_config.eagle_aux_hidden_state_layer_ids`): what `set_eagle3_layers_to_capture(ids)`
  receives. Each architecture turns them into `layers_to_capture` by its own rule (below), so the
  ids we write depend on the target's architecture. tests/test_sglang_layers.py runs SGLang's own
  `set_eagle3_layers_to_capture` for every architecture in the wheel to hold this table to it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.capture.layers import default_capture_layers, to_sglang_numbering, validate_layers
from engine.errors import EngineError


class TargetError(EngineError, ValueError):
    """The target's config.json cannot be planned; the message names the problem and the fix."""


class LayerIdRule(enum.Enum):
    """How `set_eagle3_layers_to_capture(ids)` turns SGLang layer ids into `layers_to_capture`."""

    ADD_ONE = "adds 1 to every id"
    ADD_ONE_IF_FIRST_IS_ONE = "adds 1 only when the first id is 1, else uses the ids as given"
    KEYWORD_AUX = "hands aux states to the logits processor by keyword (invisible to a forward hook)"
    UNKNOWN = "not an EAGLE-3 target in SGLang 0.5.23"


# SGLang 0.5.23 (python/sglang/srt/models/): architectures whose rule is not ADD_ONE. The DeepSeek
# family's rule lives in deepseek_v2.py (DeepseekV2ForCausalLM.set_eagle3_layers_to_capture);
# Kimi-K2.5 delegates to its DeepseekV3 language model; MistralLarge3 and GlmMoeDsa inherit it.
ADD_ONE_IF_FIRST_IS_ONE = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMNextN",
    "Glm4MoeLiteForCausalLM", "Glm4MoeLiteForCausalLMNextN", "Glm5NextForConditionalGenerationNextN",
    "GlmMoeDsaForCausalLM", "GlmMoeDsaForCausalLMNextN", "KimiK25ForConditionalGeneration",
    "MistralLarge3ForCausalLM", "MistralLarge3ForCausalLMEagle",
})
# Every other architecture with set_eagle3_layers_to_capture in 0.5.23 adds 1 (the table test lists
# them from the wheel). Architectures absent from both sets are not EAGLE-3 targets there.
ADD_ONE = frozenset({
    "ApertusForCausalLM", "BailingMoEForCausalLM", "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
    "Cosmos3ForConditionalGeneration", "EmbeddingGemmaModel", "ExaoneMoEForCausalLM", "ExaoneMoEForCausalLMMTP",
    "ExaoneMoeForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma4AssistantForCausalLM",
    "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4UnifiedAssistantForCausalLM",
    "Gemma4UnifiedForConditionalGeneration", "Glm4MoeForCausalLM", "Glm4MoeForCausalLMNextN",
    "Glm5NextForConditionalGeneration", "GptOssForCausalLM", "IQuestCoderForCausalLM", "InternLM3ForCausalLM",
    "InternS1ProForConditionalGeneration", "InternS2MobiusForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration", "Llama4ForCausalLM", "Llama4ForConditionalGeneration",
    "LlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLMEagle3", "LongcatFlashForCausalLM",
    "LongcatFlashForCausalLMNextN", "MellumForCausalLM", "MiniMaxM2ForCausalLM", "MiniMaxM3SparseForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration", "Ministral3ForCausalLM", "MistralForCausalLM",
    "MistralForCausalLMEagle", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen2ForCausalLMEagle",
    "Qwen2MoeForCausalLM", "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3MoeForCausalLMMTP", "Qwen3NextForCausalLM", "Qwen3NextForCausalLMMTP",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
    "Qwen4ExpForConditionalGeneration", "SarvamMoEForCausalLM", "TeleFLMForCausalLM",
})
# Models that pass aux_hidden_states to the logits processor by keyword: a forward hook's positional
# args never see them, so capture through the SGLang backend cannot work (the table test finds them).
KEYWORD_AUX = frozenset({"BailingMoeV3ForCausalLM", "MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM", "OPTForCausalLM"})


def layer_id_rule(architecture: str) -> LayerIdRule:
    if architecture in KEYWORD_AUX:
        return LayerIdRule.KEYWORD_AUX
    if architecture in ADD_ONE_IF_FIRST_IS_ONE:
        return LayerIdRule.ADD_ONE_IF_FIRST_IS_ONE
    if architecture in ADD_ONE:
        return LayerIdRule.ADD_ONE
    return LayerIdRule.UNKNOWN


def sglang_layers_to_capture(rule: LayerIdRule, ids: list[int]) -> list[int]:
    """What SGLang's `set_eagle3_layers_to_capture(ids)` sets, by the architecture's rule."""
    if rule is LayerIdRule.ADD_ONE_IF_FIRST_IS_ONE and not (ids and ids[0] == 1):
        return list(ids)
    return [i + 1 for i in ids]


def served_layers(architecture: str, ids: list[int]) -> list[int]:
    """Decoder layers (ours) whose outputs SGLang feeds a drafter whose export holds `ids`.

    Unknown architectures are read with the common ADD_ONE rule (what a Llama-family target does).
    """
    rule = layer_id_rule(architecture)
    if rule in (LayerIdRule.UNKNOWN, LayerIdRule.KEYWORD_AUX):
        rule = LayerIdRule.ADD_ONE
    return [j - 1 for j in sglang_layers_to_capture(rule, [int(i) for i in ids])]


def sglang_layer_ids(architecture: str, ours: list[int]) -> list[int]:
    """The ids to hand SGLang (flag and export) so that it serves the outputs of decoder layers `ours`.

    ValueError when the architecture's rule cannot express `ours` (DeepSeek's rule shifts any list
    starting at 1 again, so the output of layer 0 cannot be the first capture layer).
    """
    rule = layer_id_rule(architecture)
    if rule is LayerIdRule.ADD_ONE_IF_FIRST_IS_ONE and ours and ours[0] != 1:
        ids = [layer + 1 for layer in ours]
        if ids[0] == 1:
            raise ValueError(
                f"{architecture} on SGLang cannot serve layer 0's output as the first capture layer (it shifts an "
                "id list starting at 1 again); choose a first capture layer of 1 or more in model.capture_layers")
        return ids
    return list(ours)


@dataclass(frozen=True)
class TargetPlan:
    """The target as every stage sees it. Build it with `plan_target`."""

    model_dir: Path
    architecture: str
    text_config_key: str | None  # "text_config" for multimodal wrappers, else None
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str | None
    capture_layers: tuple[int, ...]  # ours: outputs of these decoder layers
    capture_source: str  # "model.capture_layers" or "default [1, L//2-1, L-4]"
    text: dict[str, Any]  # the text model's config (flattened for multimodal wrappers)

    @property
    def rule(self) -> LayerIdRule:
        return layer_id_rule(self.architecture)

    @property
    def sglang_ids(self) -> list[int]:
        """For `--return-aux-hidden-state-layer-ids` and the export's eagle_aux_hidden_state_layer_ids."""
        return sglang_layer_ids(self.architecture, list(self.capture_layers))

    @property
    def layers_to_capture(self) -> list[int]:
        """SGLang's internal `layers_to_capture` (input of layer j): ours + 1."""
        return to_sglang_numbering(self.capture_layers)

    def describe_layers(self) -> str:
        return (f"outputs of decoder layers {list(self.capture_layers)} (0-indexed, {self.capture_source}) = SGLang "
                f"layers_to_capture {self.layers_to_capture}; SGLang layer ids {self.sglang_ids} for "
                f"{self.architecture} ({self.rule.value})")

    def sglang_refusal(self) -> str | None:
        """Why SGLang cannot capture this target through our hook, or None."""
        if self.rule is LayerIdRule.KEYWORD_AUX:
            return (f"{self.architecture} hands aux hidden states to SGLang's logits processor by keyword, which a "
                    "forward hook cannot see; capture it with model.backend = \"local\"")
        if self.rule is LayerIdRule.UNKNOWN:
            return (f"{self.architecture} has no set_eagle3_layers_to_capture in SGLang 0.5.23, so SGLang cannot "
                    "capture aux hidden states for it; use model.backend = \"local\"")
        return None


def read_config(model_dir: Path) -> dict[str, Any]:
    """The raw config.json; TargetError naming the file and the fix."""
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TargetError(f"{path} missing; point model.path at a Hugging Face model directory") from None
    except (OSError, ValueError) as exc:
        raise TargetError(f"{path} unreadable ({exc}); restore config.json from the model's source") from None
    if not isinstance(data, dict):
        raise TargetError(f"{path} is not a JSON object; restore config.json from the model's source")
    return data


def _text_config(data: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The text model's config (a multimodal wrapper's text_config merged over it) and where it was."""
    for key in ("text_config", "language_config"):
        text = data.get(key)
        if isinstance(text, dict) and "num_hidden_layers" in text:
            merged = {k: v for k, v in data.items() if k not in ("text_config", "language_config")}
            merged.update({k: v for k, v in text.items() if k != "architectures"})
            return merged, key
    return dict(data), None


SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size")


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0  # JSON `true` is no size


def config_sizes(text: dict[str, Any]) -> tuple[int, int, int] | None:
    """The text config's layer count, hidden size and vocabulary size; None unless all three are
    positive integers."""
    if bad_sizes(text):
        return None
    layers, hidden, vocab = (int(text[name]) for name in SIZE_FIELDS)
    return layers, hidden, vocab


def bad_sizes(text: dict[str, Any]) -> list[str]:
    """`name=value` for each of SIZE_FIELDS that is not a positive integer."""
    return [f"{name}={text.get(name)!r}" for name in SIZE_FIELDS if not _is_size(text.get(name))]


def text_config(model_dir: Path) -> dict[str, Any]:
    """The text model's config.json (flattened for multimodal wrappers); TargetError when unreadable."""
    return _text_config(read_config(model_dir))[0]


def plan_target(model_dir: Path, configured_layers: list[int] | tuple[int, ...] = ()) -> TargetPlan:
    """Resolve the target once; TargetError naming the problem and the fix."""
    model_dir = Path(model_dir)
    data = read_config(model_dir)
    text, key = _text_config(data)
    sizes = config_sizes(text)
    if sizes is None:
        raise TargetError(f"{model_dir}/config.json gives {', '.join(bad_sizes(text))}; it must give positive "
                          "integers for num_hidden_layers, hidden_size and vocab_size (in text_config for multimodal models)")
    layers, hidden, vocab = sizes
    architectures = data.get("architectures") or []
    architecture = str(architectures[0]) if architectures else "?"
    if configured_layers:
        ours, source = list(configured_layers), "model.capture_layers"
        try:
            validate_layers(ours, layers)
        except ValueError as exc:
            raise TargetError(f"model.capture_layers {ours}: {exc}; use three increasing ids in 0..{layers - 2}, "
                              "or [] for the default") from None
    else:
        source = "default [1, L//2-1, L-4]"
        try:
            ours = default_capture_layers(layers)
        except ValueError as exc:
            raise TargetError(f"{exc}; EAGLE-3 needs a bigger target") from None
    plan = TargetPlan(
        model_dir=model_dir, architecture=architecture, text_config_key=key, num_layers=layers,
        hidden_size=hidden, vocab_size=vocab, dtype=text.get("torch_dtype") or text.get("dtype"),
        capture_layers=tuple(ours), capture_source=source, text=text,
    )
    try:
        plan.sglang_ids  # noqa: B018 - refuse now what the export or the flag could not express
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    return plan


def workspace_plan(workspace) -> TargetPlan:
    """The plan for a workspace's configured target."""
    return plan_target(workspace.model_dir, list(workspace.config.model.capture_layers))
