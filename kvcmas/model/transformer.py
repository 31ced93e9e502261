"""A compact Llama / Qwen2 decoder forward with explicit KV, positions and layer ranges.

Every call works on a set of token rows at explicit absolute positions, over a chosen range
of layers, writing each layer's K/V for those rows into a :class:`KVCache` and attending to
every cached key whose position is at most the query's (the exact causal mask). That one
primitive covers dense prefill, decoding, and the selective recomputation of baselines that
recompute some layers for some tokens on top of reused K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcmas.model.cache import KVCache
from kvcmas.model.config import ModelConfig
from kvcmas.model.rope import apply_rope, cos_sin, inverse_frequencies


@dataclass
class LayerWeights:
    ln_attn: torch.Tensor
    wqkv: torch.Tensor  # q, k and v projections fused into one GEMM
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    ln_mlp: torch.Tensor
    # Gate and up stay two GEMMs: one fused [2I, H] GEMM with strided halves measured 5% slower
    # at 4K-token prefill (fp32, 1 thread), while q/k/v fuse well.
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T, hidden] after the last layer run (before the final norm)
    logits: torch.Tensor | None  # [T', vocab] for the requested rows, float32
    captured: dict[int, torch.Tensor]  # layer -> hidden input to that layer


class Transformer:
    """Weights and forward of one decoder-only model."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
    ):
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.inv_freq = inverse_frequencies(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @classmethod
    def from_state_dict(
        cls, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> Transformer:
        """Build from Hugging Face parameter names (``model.layers.0.mlp.up_proj.weight``...)."""

        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"checkpoint lacks parameter {name!r}")
            return state[name].to(dtype).contiguous()

        layers = []
        for i in range(config.n_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if config.qkv_bias:
                bias = torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"])
            layers.append(
                LayerWeights(
                    ln_attn=get(p + "input_layernorm.weight"),
                    wqkv=torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"]),
                    bqkv=bias,
                    wo=get(a + "o_proj.weight"),
                    ln_mlp=get(p + "post_attention_layernorm.weight"),
                    w_gate=get(p + "mlp.gate_proj.weight"),
                    w_up=get(p + "mlp.up_proj.weight"),
                    w_down=get(p + "mlp.down_proj.weight"),
                )
            )
        embed = get("model.embed_tokens.weight")
        head = embed if config.tie_embeddings else get("lm_head.weight")
        return cls(config, embed, layers, get("model.norm.weight"), head)

    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, self.dtype, capacity)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 and scale in the model dtype, as the reference models do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed)

    def project_kv(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, rope=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [Hq,T,Dh], k [Hkv,T,Dh] (rotated to ``positions``), v [Hkv,T,Dh] of one layer."""
        c = self.config
        w = self.layers[layer]
        x = self._rms_norm(hidden, w.ln_attn)
        qkv = F.linear(x, w.wqkv, w.bqkv)
        nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        t = hidden.shape[0]
        q = qkv[:, :nq].view(t, c.n_heads, c.head_dim).transpose(0, 1)
        k = qkv[:, nq : nq + nk].view(t, c.n_kv_heads, c.head_dim).transpose(0, 1)
        v = qkv[:, nq + nk :].view(t, c.n_kv_heads, c.head_dim).transpose(0, 1)
        cos, sin = rope if rope is not None else cos_sin(self.inv_freq, positions, hidden.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()

    def _attend(
        self, q: torch.Tensor, cache: KVCache, layer: int, positions: torch.Tensor
    ) -> torch.Tensor:
        # A leading batch dim keeps CPU SDPA on its fused kernel (3-D inputs take the math
        # path, ~6x slower at 1K tokens).
        keys, values = cache.keys(layer)[None], cache.values(layer)[None]
        q = q[None]
        n_keys = keys.shape[2]
        t = q.shape[2]
        contiguous_tail = positions[0].item() == n_keys - t and (
            t == 1 or positions[-1].item() == n_keys - 1
        )
        if contiguous_tail and t == n_keys:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        elif contiguous_tail and t == 1:
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        else:
            # Exact causal mask by absolute position: key position <= query position.
            mask = torch.arange(n_keys)[None, :] <= positions[:, None]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(t, -1)

    def run_layer(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        rope=None,
    ) -> torch.Tensor:
        """One decoder layer for rows at ``positions``; writes their K/V into ``cache``.
        ``rope`` optionally passes the (cos, sin) tables of ``positions``, shared by layers."""
        w = self.layers[layer]
        q, k, v = self.project_kv(layer, hidden, positions, rope)
        cache.write(layer, positions, k, v)
        h = hidden + F.linear(self._attend(q, cache, layer, positions), w.wo)
        x = self._rms_norm(h, w.ln_mlp)
        act = F.silu(F.linear(x, w.w_gate)).mul_(F.linear(x, w.w_up))
        return h + F.linear(act, w.w_down)

    def forward(
        self,
        tokens: torch.Tensor | None,
        positions: torch.Tensor,
        cache: KVCache,
        *,
        layers: range | None = None,
        hidden: torch.Tensor | None = None,
        logits_rows: slice | torch.Tensor | None = slice(-1, None),
        capture: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Run ``layers`` (default all) for the rows at ``positions``.

        Rows enter as ``tokens`` when the range starts at layer 0, else as ``hidden`` (the
        hidden input to ``layers.start``). The cache grows to cover ``max(positions)+1``; rows
        attend to every cached position up to their own, so positions skipped here must
        already hold K/V for the layers run. ``logits_rows`` picks rows for the LM head when
        the range ends at the last layer (None: no logits).
        """
        c = self.config
        layers = layers if layers is not None else range(c.n_layers)
        if len(positions) == 0:
            raise ValueError("forward needs at least one row")
        if int(positions.max()) >= c.max_position:
            raise ValueError(
                f"position {int(positions.max())} exceeds the model's context of "
                f"{c.max_position} tokens"
            )
        if hidden is None:
            if layers.start != 0 or tokens is None:
                raise ValueError("rows entering after layer 0 need their hidden states")
            hidden = self.embed_tokens(tokens)
        cache.extend_to(int(positions.max()) + 1)
        captured = {}
        with torch.inference_mode():
            rope = cos_sin(self.inv_freq, positions, hidden.dtype)
            for layer in layers:
                if layer in capture:
                    captured[layer] = hidden
                hidden = self.run_layer(layer, hidden, positions, cache, rope)
            logits = None
            if layers.stop == c.n_layers and logits_rows is not None:
                logits = self.logits(hidden[logits_rows])
        return ForwardOutput(hidden=hidden, logits=logits, captured=captured)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, float32 logits."""
        return F.linear(self._rms_norm(hidden, self.norm), self.lm_head).float()

    def prefill(self, tokens: list[int] | torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append ``tokens`` densely after the cached context; float32 logits of the last one."""
        ids = torch.as_tensor(tokens, dtype=torch.long)
        start = cache.length
        positions = torch.arange(start, start + len(ids))
        return self.forward(ids, positions, cache).logits[-1]
