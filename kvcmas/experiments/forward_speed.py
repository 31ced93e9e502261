"""Prefill throughput of our forward against transformers' forward, side by side in one run."""

from __future__ import annotations

import time

import torch

from kvcmas.model.loader import load_model, parse_dtype


def _best_of_interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Best wall time of each function, run in turns (A B A B ...) after one warm-up each, so
    that drift in the machine's state (caches, clocks, a neighbour) hits every side alike."""
    for fn in fns.values():
        fn()  # warm-up: allocator, kernels
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure_prefill(
    model_spec: str, lengths=(1024, 4096), dtypes=("fp32", "bf16"), repeats: int = 3, log=print
) -> list[dict]:
    """Tokens/s of a full prefill (last-token logits only, as generation needs) for both."""
    from transformers import AutoModelForCausalLM

    rows = []
    for dtype in dtypes:
        loaded = load_model(model_spec, dtype)
        hf = AutoModelForCausalLM.from_pretrained(loaded.folder, dtype=parse_dtype(dtype)).eval()
        for n in lengths:
            n = min(n, loaded.config.max_position)
            ids = torch.randint(100, loaded.config.vocab_size - 100, (n,))

            def ours(model=loaded.model, ids=ids, n=n):
                model.prefill(ids, model.new_cache(capacity=n))

            def theirs(hf=hf, ids=ids):
                with torch.inference_mode():
                    hf(ids[None], logits_to_keep=1, use_cache=True)

            best = _best_of_interleaved({"ours": ours, "theirs": theirs}, repeats)
            t_ours, t_hf = best["ours"], best["theirs"]
            row = {
                "model": loaded.name,
                "dtype": dtype,
                "tokens": n,
                "ours_tok_s": n / t_ours,
                "transformers_tok_s": n / t_hf,
                "speedup": t_hf / t_ours,
            }
            rows.append(row)
            log(
                f"{dtype} {n:5d} tokens: ours {row['ours_tok_s']:7.0f} tok/s, transformers "
                f"{row['transformers_tok_s']:7.0f} tok/s, ratio {row['speedup']:.2f}x"
            )
    return rows

