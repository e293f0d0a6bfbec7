"""The EAGLE-3 draft model in plain PyTorch, with module names equal to SGLang's weight names.

One Llama decoder layer (`midlayer`) whose attention reads `cat(input_layernorm(embed),
hidden_norm(fc(aux)))` (2H wide); the residual is the un-normalised fc output. Then SwiGLU MLP,
final `norm`, `lm_head` over the draft vocabulary. `embed_tokens` is the target's, frozen (SGLang
replaces it with the target's at serve time, so it is never exported).

`step()` runs one training-time-test step: it returns the pre-norm output (fed back as the
next step's feature, exactly what SGLang's draft returns as its aux state) and appends this
step's keys/values to `cache` so later steps can attend to them (see engine.train.attention).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn
import torch.nn.functional as F

from engine.train.attention import DEFAULT_BACKEND
from engine.train.mixed import CastLinear, compiled_or_eager, rms_norm, stacked_linear, stacked_linears, swiglu


@dataclass
class DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # target vocabulary (embedding rows, d2t targets)
    draft_vocab_size: int
    target_hidden_size: int = 0  # 0 = hidden_size
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # SGLang layer ids as exported (eagle_aux_hidden_state_layer_ids): per the target architecture's rule,
    # not our layer numbers (engine/model/target.py).
    aux_layers_sglang: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.target_hidden_size:
            self.target_hidden_size = self.hidden_size
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target(cls, target: dict, draft_vocab_size: int, aux_layers_sglang: list[int]) -> "DraftConfig":
        """Sizes copied from the target's config.json (a text_config is used when present)."""
        t = target.get("text_config") or target
        heads = int(t["num_attention_heads"])
        return cls(
            hidden_size=int(t["hidden_size"]), num_attention_heads=heads,
            num_key_value_heads=int(t.get("num_key_value_heads") or heads),
            intermediate_size=int(t["intermediate_size"]), vocab_size=int(t["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size), target_hidden_size=int(t["hidden_size"]),
            head_dim=int(t.get("head_dim") or 0), rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
            rope_theta=float(t.get("rope_theta") or (t.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
            max_position_embeddings=int(t.get("max_position_embeddings") or 2048),
            aux_layers_sglang=list(aux_layers_sglang),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [T, head_dim] for the neox (rotate-half) layout that HF and SGLang Llama use."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


# On CUDA one fused kernel each way for q and k (they are strided views of the projections: eager, each of
# the rotation's five elementwise ops was its own non-vectorised kernel, forward and backward, per TTT step).
rope_qk = compiled_or_eager(_rope_qk)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = CastLinear(2 * cfg.hidden_size, h * d, bias=False)
        self.k_proj = CastLinear(2 * cfg.hidden_size, kv * d, bias=False)
        self.v_proj = CastLinear(2 * cfg.hidden_size, kv * d, bias=False)
        self.o_proj = CastLinear(h * d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list, backend: str) -> torch.Tensor:
        from engine.train.attention import ttt_attention

        b, t, _ = x.shape
        d, h, kv = self.cfg.head_dim, self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q, k, v = stacked_linears(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(b, t, h, d).transpose(1, 2)
        k = k.view(b, t, kv, d).transpose(1, 2)
        # v is kept (cache, attention's backward) where RoPE replaces q and k: its own copy lets the stacked
        # projection's output go once RoPE has read it.
        v = v.contiguous().view(b, t, kv, d).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, d, self.cfg.rope_theta, q.dtype)
        q, k = rope_qk(q, k, cos, sin)
        cache.append((k, v))
        out = ttt_attention(q, [c[0] for c in cache], [c[1] for c in cache], backend)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h * d))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = CastLinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = CastLinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = CastLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = stacked_linear(x, (self.gate_proj, self.up_proj))
        if gate_up is None:  # evaluation, or separate projections asked: two GEMMs, as before
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(swiglu(gate_up))


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, positions, cache, backend):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = residual + self.self_attn(x, positions, cache, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = CastLinear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = CastLinear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.d2t: torch.Tensor  # buffers (saved with the weights), declared for the type checker
        self.t2d: torch.Tensor
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [B, T, 3*Ht] -> the step-0 feature [B, T, H]."""
        return self.fc(aux)

    def step(self, input_ids, hidden, position_offset: int, cache: list, backend: str = DEFAULT_BACKEND):
        """One TTT step: tokens [B, T] and features [B, T, H] -> pre-norm output [B, T, H]."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) + position_offset
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        return self.midlayer(embeds, hidden, positions, cache, backend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    @torch.no_grad()
    def draft_logits(self, input_ids, aux, steps: int = 1, backend: str = DEFAULT_BACKEND) -> list[torch.Tensor]:
        """Logits of the first `steps` TTT steps (for tests and evaluation)."""
        hidden = self.project(aux)
        cache: list = []
        out: list[torch.Tensor] = []
        for k in range(steps):
            ids = shift_left(input_ids, k + 1)
            hidden = self.step(ids, hidden, k, cache, backend)
            out.append(self.logits(hidden))
        return out


def shift_left(ids: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """ids[:, t] -> ids[:, t + n], padded with `fill` at the end."""
    if n == 0:
        return ids
    pad = torch.full_like(ids[:, :n], fill)
    return torch.cat([ids[:, n:], pad], dim=1)[:, : ids.shape[1]]
