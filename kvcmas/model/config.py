"""Model configuration: the few numbers our forward needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcmas.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = {"llama": False, "qwen2": True}  # model_type -> q/k/v bias



@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    qkv_bias: bool
    tie_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # Llama-3 style frequency scaling; None for plain RoPE.
    rope_scaling: dict[str, float] | None = field(default=None)

    @property
    def kv_width(self) -> int:
        """D in METHOD.md: features per token per layer for K (and for V)."""
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a transformers config dict; refuse what we cannot run exactly."""
        model_type = hf.get("model_type", "?")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r}: kvcmas runs llama and qwen2 models"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported activation {hf['hidden_act']!r}")
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        scaling = None
        if rope_type == "llama3":
            scaling = {
                k: float(rope[k])
                for k in (
                    "factor",
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                )
            }
        elif rope_type != "default":
            # YaRN, dynamic NTK, M-RoPE...: positions do not compose as pure rotations.
            raise UnsupportedModelError(
                f"unsupported RoPE variant {rope_type!r}: only default and llama3 compose exactly"
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads", n_heads),
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position=hf.get("max_position_embeddings", 4096),
            qkv_bias=SUPPORTED_ARCHITECTURES[model_type] or bool(hf.get("attention_bias")),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            rope_scaling=scaling,
        )
