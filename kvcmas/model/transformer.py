"""A compact Llama / Qwen2 decoder forward with explicit KV, positions and layer ranges.

Every call works on a set of token rows at explicit absolute positions, over a chosen range
of layers, writing each layer's K/V for those rows into a :class:`KVCache` and attending to
every cached key whose position is at most the query's (the exact causal mask). That one
primitive covers dense prefill, decoding, and the selective recomputation of baselines that
recompute some layers for some tokens on top of reused K/V.

The model lives on one device (its weights'); caches, masks and position tables are made
there. Token ids and positions may be passed on any device: they are small index tensors
and are moved to the model's. Hidden states passed in must already be on it.
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
        # Computed on the CPU then moved, so every device rotates by the same frequencies.
        self.inv_freq = inverse_frequencies(config).to(embed.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def gemm_dtype(self) -> torch.dtype:
        """The dtype the matrix products run in (see :meth:`from_state_dict`)."""
        return self.lm_head.dtype

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        gemm_dtype: torch.dtype | None = None,
    ) -> Transformer:
        """Build from Hugging Face parameter names (``model.layers.0.mlp.up_proj.weight``...),
        with the weights on ``device``.

        ``gemm_dtype`` (default ``dtype``) is the dtype the matrix products run in. A wider one
        keeps the numbers of ``dtype``: the projection weights hold ``dtype``'s values, stored
        wide, and each product's input and output are rounded to ``dtype``, so only the
        summation order differs from a native ``dtype`` GEMM (which accumulates in float32
        too). bf16 with float32 GEMMs runs at float32 speed on CPUs without bf16
        instructions, where a native bf16 GEMM is about 6x slower.
        """

        def get(name: str, gemm: bool = False) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"checkpoint lacks parameter {name!r}")
            t = state[name].to(device=device, dtype=dtype)
            if gemm and gemm_dtype is not None:
                t = t.to(gemm_dtype)
            return t.contiguous()

        layers = []
        for i in range(config.n_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if config.qkv_bias:
                bias = torch.cat([get(a + f"{n}_proj.bias", gemm=True) for n in "qkv"])
            layers.append(
                LayerWeights(
                    ln_attn=get(p + "input_layernorm.weight"),
                    wqkv=torch.cat([get(a + f"{n}_proj.weight", gemm=True) for n in "qkv"]),
                    bqkv=bias,
                    wo=get(a + "o_proj.weight", gemm=True),
                    ln_mlp=get(p + "post_attention_layernorm.weight"),
                    w_gate=get(p + "mlp.gate_proj.weight", gemm=True),
                    w_up=get(p + "mlp.up_proj.weight", gemm=True),
                    w_down=get(p + "mlp.down_proj.weight", gemm=True),
                )
            )
        embed = get("model.embed_tokens.weight")
        if not config.tie_embeddings:
            head = get("lm_head.weight", gemm=True)
        elif gemm_dtype in (None, dtype):
            head = embed
        else:
            head = get("model.embed_tokens.weight", gemm=True)  # a wide copy for the GEMM
        return cls(config, embed, layers, get("model.norm.weight"), head)

    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, self.dtype, capacity, self.device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 and scale in the model dtype, as the reference models do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if w.dtype == x.dtype:
            return F.linear(x, w, b)
        # Weights stored wider than the activations (``gemm_dtype``): multiply wide, round back.
        return F.linear(x.to(w.dtype), w, b).to(x.dtype)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens.to(self.device), self.embed)

    def project_kv(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, rope=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [Hq,T,Dh], k [Hkv,T,Dh] (rotated to ``positions``), v [Hkv,T,Dh] of one layer."""
        c = self.config
        w = self.layers[layer]
        positions = positions.to(hidden.device)
        x = self._rms_norm(hidden, w.ln_attn)
        qkv = self._linear(x, w.wqkv, w.bqkv)
        nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        t = hidden.shape[0]
        q = qkv[:, :nq].view(t, c.n_heads, c.head_dim).transpose(0, 1)
        k = qkv[:, nq : nq + nk].view(t, c.n_kv_heads, c.head_dim).transpose(0, 1)
        v = qkv[:, nq + nk :].view(t, c.n_kv_heads, c.head_dim).transpose(0, 1)
        cos, sin = rope if rope is not None else cos_sin(self.inv_freq, positions, hidden.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()

    def _attend(
        self, q: torch.Tensor, cache: KVCache, layer: int, plan: AttentionPlan
    ) -> torch.Tensor:
        # A leading batch dim keeps CPU SDPA on its fused kernel (3-D inputs take the math
        # path, ~6x slower at 1K tokens).
        keys = cache.k[layer, :, : plan.n_keys][None]
        values = cache.v[layer, :, : plan.n_keys][None]
        t = q.shape[1]
        if plan.pad:
            q = torch.cat([q.new_zeros(q.shape[0], plan.pad, q.shape[2]), q], dim=1)
        out = F.scaled_dot_product_attention(
            q[None], keys, values, attn_mask=plan.mask, is_causal=plan.causal, enable_gqa=True
        )[0, :, plan.pad :]
        return out.transpose(0, 1).reshape(t, -1)

    def run_layer(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        rope=None,
        attention: AttentionPlan | None = None,
    ) -> torch.Tensor:
        """One decoder layer for rows at ``positions``; writes their K/V into ``cache``.
        ``rope`` and ``attention`` optionally pass the (cos, sin) tables of ``positions`` and
        their :func:`attention_plan`, shared by layers."""
        w = self.layers[layer]
        positions = positions.to(hidden.device)
        q, k, v = self.project_kv(layer, hidden, positions, rope)
        cache.write(layer, positions, k, v)
        plan = attention or attention_plan(positions, cache.length)
        h = hidden + self._linear(self._attend(q, cache, layer, plan), w.wo)
        x = self._rms_norm(h, w.ln_mlp)
        act = F.silu(self._linear(x, w.w_gate)).mul_(self._linear(x, w.w_up))
        return h + self._linear(act, w.w_down)

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
        positions = positions.to(self.device)
        top = int(positions.max())
        if top >= c.max_position:
            raise ValueError(
                f"position {top} exceeds the model's context of {c.max_position} tokens"
            )
        if hidden is None:
            if layers.start != 0 or tokens is None:
                raise ValueError("rows entering after layer 0 need their hidden states")
            hidden = self.embed_tokens(tokens)
        cache.extend_to(top + 1)
        captured = {}
        with torch.inference_mode():
            rope = cos_sin(self.inv_freq, positions, hidden.dtype)
            attention = attention_plan(positions, cache.length)
            for layer in layers:
                if layer in capture:
                    captured[layer] = hidden
                hidden = self.run_layer(layer, hidden, positions, cache, rope, attention)
            logits = None
            if layers.stop == c.n_layers and logits_rows is not None:
                logits = self.logits(hidden[logits_rows])
        return ForwardOutput(hidden=hidden, logits=logits, captured=captured)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, float32 logits."""
        return self._linear(self._rms_norm(hidden, self.norm), self.lm_head).float()

    def prefill(self, tokens: list[int] | torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append ``tokens`` densely after the cached context; float32 logits of the last one."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        start = cache.length
        positions = torch.arange(start, start + len(ids), device=self.device)
        return self.forward(ids, positions, cache).logits[-1]


@dataclass(frozen=True)
class AttentionPlan:
    """How a forward's rows attend, the same in every layer: to the first ``n_keys`` cached
    keys, under an explicit boolean ``mask`` or SDPA's ``causal`` flag, after ``pad`` zero
    query rows put in front (and dropped from the output)."""

    n_keys: int
    mask: torch.Tensor | None = None
    causal: bool = False
    pad: int = 0


def attention_plan(positions: torch.Tensor, cache_length: int) -> AttentionPlan:
    """The exact causal attention (key position <= query position) of rows at ``positions``,
    at the least cost. Built once per forward, with one host read of the positions.

    * Keys past the last row are masked for every row, so they are not read at all: a span's
      head repaired in front of the rest of the span attends to the context and the head only.
    * Rows that are the tail of those keys (a prefill after a cached context) need no mask:
      SDPA's causal flag aligns rows to keys from the top left, so ``pad`` zero rows in front
      make the rows the bottom of a square. Worth it while the padding (``n_keys**2/2``
      scores, half skipped) costs less than the mask (``t * n_keys``): ``2t >= n_keys``.
      One decoded row needs nothing.
    * Any other rows (scattered recomputation) get the explicit mask.
    """
    t = len(positions)
    first, last, top = torch.stack([positions[0], positions[-1], positions.max()]).tolist()
    n_keys = top + 1
    if n_keys > cache_length:
        raise ValueError(f"row position {top} is past the cache's {cache_length} positions")
    if first == n_keys - t and last == top:  # the keys' contiguous tail
        if t == 1:
            return AttentionPlan(n_keys)
        if 2 * t >= n_keys:
            return AttentionPlan(n_keys, causal=True, pad=n_keys - t)
    keys = torch.arange(n_keys, device=positions.device)
    return AttentionPlan(n_keys, mask=keys[None, :] <= positions[:, None])
