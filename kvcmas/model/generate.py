"""Greedy decoding on an explicit KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcmas.model.cache import KVCache
from kvcmas.model.transformer import Transformer


@dataclass
class Decoded:
    tokens: list[int]  # generated ids, stop token excluded
    hit_stop: bool
    first_logits: torch.Tensor  # float32 logits that chose the first token
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, hidden]


def stop_ids(loaded) -> set[int]:
    """Every id that ends an assistant turn: config, generation config and tokenizer EOS."""
    ids = set(loaded.config.eos_token_ids)
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    gen = loaded.folder / "generation_config.json"
    if gen.exists():
        import json

        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def greedy_decode(
    model: Transformer,
    cache: KVCache,
    logits: torch.Tensor,
    max_new_tokens: int,
    stop: set[int],
    feed_last: bool = True,
    capture: tuple[int, ...] = (),
    forced: Sequence[int] | None = None,
) -> Decoded:
    """Decode greedily from ``logits`` (the prompt's last-token logits), appending to ``cache``.

    With ``feed_last`` the final generated token is also run through the model when the budget
    ends generation, so the cache then holds K/V for every output token: an agent output's
    cache in its producer is complete and exact (METHOD.md section 2, rule 4). ``capture``
    names layers whose hidden input is kept for every fed token (``Decoded.captured``).
    ``forced`` replays an output produced elsewhere (a serving engine's): its tokens are fed
    instead of the argmax, and generation ends after them as at the budget.
    """
    first = logits
    tokens: list[int] = []
    kept: dict[int, list[torch.Tensor]] = {layer: [] for layer in capture}
    hit_stop = False
    budget = max_new_tokens if forced is None else len(forced)
    for step in range(budget):
        nxt = int(torch.argmax(logits)) if forced is None else int(forced[step])
        if forced is None and nxt in stop:
            hit_stop = True
            break
        tokens.append(nxt)
        if step == budget - 1 and not feed_last:
            break
        if not capture:
            logits = model.prefill([nxt], cache)
            continue
        pos = torch.tensor([cache.length], device=model.device)
        out = model.forward(torch.tensor([nxt], device=model.device), pos, cache, capture=capture)
        logits = out.logits[-1]
        for layer in capture:
            kept[layer].append(out.captured[layer])
    captured = {layer: torch.cat(rows) for layer, rows in kept.items() if rows}
    return Decoded(tokens=tokens, hit_stop=hit_stop, first_logits=first, captured=captured)
