"""A lean decode runner for Llama-architecture transformers targets (evaluation only).

transformers' forward spends most of a small target's time per token on Python and kernel-launch
overhead (mask building, cache classes, output capture), which hides any speculative-decoding gain
(bench/RESULTS.md, End to end on the H200).
This runner computes the same function with a fraction of the launches:

- weights come from the loaded HF model; q/k/v and gate/up are fused into one matmul each. The
  fused tensors become the storage of the HF parameters (they are rebound as views), so no weight
  is held twice and in-place edits of the HF parameters are seen by both paths;
- RoPE cos/sin tables are built once (from the model's own `inv_freq`, so llama3/linear scaling
  match) and grown when a longer sequence comes;
- a preallocated static KV cache [layers, kv_heads, capacity, head_dim] (k and v): a step writes
  its keys/values into the cache slice and attends over `cache[:, :, :pos + t]`; cropping is
  moving `pos` back, done by the caller through `start_pos`;
- logits only where asked (the last position, or all positions of a verify step).

`try_fast_target(model)` returns the runner (built once, kept on the model) or None when the
model is not one this runner reproduces exactly; `unsupported_reason(model)` says why.
`EAGLE3_EVAL_FAST=0` switches it off (the transformers path is the reference).

Aux states follow transformers' `hidden_states[j]` (j = SGLang aux id): j = 0 is the embedding
output, j in 1..L-1 the output of decoder layer j-1.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
import torch.nn.functional as F

FAST_ENV = "EAGLE3_EVAL_FAST"
_ATTR = "_eagle3_fast_target"
SUPPORTED_MODEL_TYPES = ("llama", "mistral")
# RoPE types whose frequencies are fixed at load time (inv_freq says it all, no attention scaling).
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
MIN_CAPACITY = 1024  # positions; so a warm-up decode already sizes the cache for the timed ones


# ----------------------------------------------------------------------------- shared kernels


def _probe_gqa() -> bool:
    """SDPA's enable_gqa (torch >= 2.5) attends grouped heads without copying keys/values."""
    try:
        q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


SDPA_GQA = _probe_gqa()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(inv_freq: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [length, head_dim] for the rotate-half layout.

    Computed as transformers does (float32 angles, then cast). The sign of rotate_half is folded into
    sin so applying RoPE is `x * cos + cat(x2, x1) * sin`."""
    positions = torch.arange(length, device=inv_freq.device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    half = inv_freq.shape[0]
    sin = emb.sin()
    sin[:, :half].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def causal_offset_mask(t: int, start: int, device) -> torch.Tensor:
    """Query i sits at position start+i and sees keys 0 .. start+i."""
    rows = torch.arange(t, device=device)[:, None] + start
    return torch.arange(start + t, device=device)[None, :] <= rows


# Bottom-right causal attention (`causal_lower_right`) for several new tokens after a cached prefix.
# On CUDA it runs flash attention without a mask tensor; a boolean mask forces the memory-efficient
# kernel plus a mask conversion in every layer. bench/decode_speed.py switches it off for its
# side-by-side rows; on CPU the explicit mask is used (the bias would only be materialised there).
LOWER_RIGHT_CAUSAL = True


def offset_causal(t: int, start: int, device: torch.device):
    """The attention mask for `t` new tokens at positions start..: None when SDPA's own `is_causal`
    (start 0) or no mask (one token) says it, else a lower-right causal bias (CUDA) or the explicit
    boolean mask. Both mean: query i sees keys 0 .. start+i."""
    if t == 1 or start == 0:
        return None
    if device.type == "cuda" and LOWER_RIGHT_CAUSAL:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(t, start + t)
    return causal_offset_mask(t, start, device)


def attend(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
           cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
           mask: torch.Tensor | None) -> torch.Tensor:
    """Fused projections [t, (h + 2kv) * hd] at positions start.. -> attention output [t, h * hd].

    RoPE on q and k (cos/sin [t, hd]), the new k/v written into the caches [1, kv, capacity, hd],
    SDPA over the first start + t cache entries. `mask` comes from `offset_causal` (None for one
    token or a prefill from position 0). Head-major views throughout: a decode step is dominated by per-op overhead."""
    t = qkv.shape[0]
    end = start + t
    qk, v = qkv.view(t, heads + 2 * kv_heads, head_dim).transpose(0, 1).split([heads + kv_heads, kv_heads])
    first, second = qk.chunk(2, dim=-1)
    qk = torch.addcmul(qk * cos, torch.cat([second, first], dim=-1), sin)  # [n, t, hd]
    q, k = qk.split([heads, kv_heads])
    keys.narrow(2, start, t).copy_(k)
    values.narrow(2, start, t).copy_(v)
    q = q.unsqueeze(0)
    keys, values = keys.narrow(2, 0, end), values.narrow(2, 0, end)
    causal = mask is None and t > 1
    if heads == kv_heads:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal)
    elif SDPA_GQA:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True)
    else:
        group = heads // kv_heads
        out = F.scaled_dot_product_attention(q, keys.repeat_interleave(group, dim=1),
                                             values.repeat_interleave(group, dim=1), attn_mask=mask,
                                             is_causal=causal)
    return out[0].transpose(0, 1).reshape(t, heads * head_dim)


def grown(capacity: int, needed: int) -> int:
    """At least doubled, so growing one position at a time copies O(n) in total."""
    return max(needed, 2 * capacity)


# ----------------------------------------------------------------------------- support check


def _norm_eps(norm) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _linear_ok(module) -> bool:
    return isinstance(module, torch.nn.Linear) and module.bias is None


def unsupported_reason(model: Any) -> str | None:
    """None when this runner reproduces `model` exactly; else a short reason."""
    cfg: Any = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not a plain Llama"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not _linear_ok(getattr(model, "lm_head", None)) or \
            not isinstance(getattr(inner, "embed_tokens", None), torch.nn.Embedding):
        return "unexpected module layout"
    if len(layers) != getattr(cfg, "num_hidden_layers", -1):
        return "layer count differs from the config"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "sliding_window", None) is not None:
        return "sliding-window attention"
    for name in ("final_logit_softcapping", "attn_logit_softcapping", "logit_scale"):
        if getattr(cfg, name, None) not in (None, 1.0):
            return f"{name} is set"
    rotary = getattr(inner, "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if rotary is None or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return "no shared rotary embedding"
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r}"
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return "RoPE attention scaling"
    heads, kv_heads = int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", None) or
                                                        cfg.num_attention_heads)
    for layer in layers:
        attn: Any = getattr(layer, "self_attn", None)
        mlp: Any = getattr(layer, "mlp", None)
        if not all(_linear_ok(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention projections with bias or of another kind"
        if not all(_linear_ok(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")):
            return "MLP projections with bias or of another kind"
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
            return "q/k norms"
        head_dim = int(getattr(attn, "head_dim", 0))
        if head_dim * heads != attn.q_proj.out_features or head_dim * kv_heads != attn.k_proj.out_features:
            return "head sizes differ from the config"
        for norm in (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)):
            if _norm_eps(norm) is None or not isinstance(getattr(norm, "weight", None), torch.Tensor):
                return "unexpected norm"
    if _norm_eps(getattr(inner, "norm", None)) is None:
        return "unexpected final norm"
    params = list(model.parameters())
    if len({(p.device, p.dtype) for p in params}) != 1 or params[0].device.type == "meta":
        return "parameters on several devices or dtypes"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):  # accelerate offloading moves weights in hooks
        return "accelerate device-map hooks"
    return None


# ----------------------------------------------------------------------------- the runner


class FastLlama:
    """Inference-only forward of a Llama target over a static KV cache (batch 1)."""

    def __init__(self, model):
        inner = model.model
        cfg = model.config
        self.layers = list(inner.layers)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(self.layers[0].self_attn.head_dim)
        self.embed = inner.embed_tokens.weight
        self.final_norm, self.final_eps = inner.norm.weight, _norm_eps(inner.norm)
        self.lm_head = model.lm_head.weight
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self.inv_freq = inner.rotary_emb.inv_freq.detach().float().clone()
        self.views: list[tuple[torch.Tensor, int]] = []  # (HF parameter, where its data must start)
        self.blocks = self._blocks()
        self.capacity = 0
        self.cache: torch.Tensor | None = None  # [layers, 2 (k, v), 1, kv_heads, capacity, head_dim]
        self.cos = self.sin = None
        self.reserve(MIN_CAPACITY)

    def _blocks(self) -> list[tuple]:
        """Per layer: (norm weight, eps, [q; k; v], o^T, norm weight, eps, [gate; up], down^T).

        The fused weights become the storage of the HF parameters (rebound as views), so nothing
        is held twice and in-place edits reach both paths. Attribute lookups on modules are done
        here once rather than in every step."""
        blocks = []
        with torch.inference_mode(False), torch.no_grad():
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                fused = []
                for mods in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
                    weight = torch.cat([m.weight.detach() for m in mods], dim=0)
                    row = 0
                    for m in mods:
                        rows = m.weight.shape[0]
                        m.weight.data = weight[row:row + rows]
                        row += rows
                    fused.append(weight)
                for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                          mlp.down_proj):
                    self.views.append((m.weight, m.weight.data_ptr()))
                blocks.append((layer.input_layernorm.weight, _norm_eps(layer.input_layernorm), fused[0],
                               attn.o_proj.weight.detach().t(), layer.post_attention_layernorm.weight,
                               _norm_eps(layer.post_attention_layernorm), fused[1],
                               mlp.down_proj.weight.detach().t()))
        return blocks

    @property
    def qkv(self) -> list[torch.Tensor]:
        return [block[2] for block in self.blocks]

    def is_current(self) -> bool:
        """False once the model's parameters were moved or replaced (then a new runner is needed)."""
        if self.embed.device != self.device or self.embed.dtype != self.dtype:
            return False
        return all(param.data_ptr() == ptr for param, ptr in self.views)

    def reserve(self, length: int) -> None:
        """Make room for `length` positions (cache and RoPE tables), keeping the cached entries."""
        if length <= self.capacity:
            return
        capacity = grown(self.capacity, length)
        cache = torch.zeros(len(self.layers), 2, 1, self.kv_heads, capacity, self.head_dim,
                            device=self.device, dtype=self.dtype)
        if self.cache is not None:
            cache[..., : self.capacity, :] = self.cache
        self.cache, self.capacity = cache, capacity
        self.layer_caches = [(cache[i, 0], cache[i, 1]) for i in range(len(self.layers))]
        self.cos, self.sin = rope_tables(self.inv_freq.to(self.device), capacity, self.dtype)

    @torch.inference_mode()  # the runner is kept on the model: its cache may be an inference tensor
    def forward(self, input_ids: torch.Tensor, start_pos: int, aux_layers: Sequence[int] = (),
                all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [1, t] at positions start_pos.. (cache entries past start_pos are overwritten).

        Returns logits [1, t or 1, V] (all positions or the last) and the aux states [1, t, len*H]
        (transformers hidden_states[j] for j in aux_layers, concatenated in that order), or None."""
        t = input_ids.shape[1]
        end = start_pos + t
        self.reserve(end)
        x = F.embedding(input_ids[0], self.embed)
        cos, sin = self.cos[start_pos:end], self.sin[start_pos:end]
        mask = offset_causal(t, start_pos, x.device)
        wanted = {int(j) for j in aux_layers}
        if any(not 0 <= j < len(self.layers) for j in wanted):
            raise ValueError(f"aux layers {list(aux_layers)} must lie in 0..{len(self.layers) - 1}")
        captured = {0: x} if 0 in wanted else {}
        h, kv, hd = self.heads, self.kv_heads, self.head_dim
        for i, (norm_in, eps_in, w_qkv, wo_t, norm_post, eps_post, w_gate_up, wd_t) in enumerate(self.blocks):
            keys, values = self.layer_caches[i]
            out = attend(F.linear(rms_norm(x, norm_in, eps_in), w_qkv), keys, values, start_pos, cos, sin,
                         h, kv, hd, mask)
            x = torch.addmm(x, out, wo_t)
            gate, up = F.linear(rms_norm(x, norm_post, eps_post), w_gate_up).chunk(2, dim=-1)
            x = torch.addmm(x, F.silu(gate) * up, wd_t)
            if i + 1 in wanted:
                captured[i + 1] = x
        last = x if all_logits else x[-1:]
        logits = F.linear(rms_norm(last, self.final_norm, self.final_eps), self.lm_head)
        aux = torch.cat([captured[int(j)] for j in aux_layers], dim=-1)[None] if wanted else None
        return logits[None], aux


def try_fast_target(model) -> FastLlama | None:
    """The runner for `model`, built once and kept on it; None when unsupported or switched off."""
    if os.environ.get(FAST_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    found = getattr(model, _ATTR, None)
    if isinstance(found, FastLlama) and found.is_current():
        return found
    if isinstance(found, str):
        return None
    reason = unsupported_reason(model)
    runner = FastLlama(model) if reason is None else None
    setattr(model, _ATTR, runner if runner is not None else reason)
    return runner
