"""Token and cost accounting: one ``usage`` row per logical request, totals for the run summary."""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

USAGE_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("stage", pa.string()),          # caption_generate, caption_judge, ...
    ("item", pa.string()),           # pair id (or whatever the stage's rows are about)
    ("model", pa.string()),
    ("cache_key", pa.string()),
    ("prompt_tokens", pa.int64()),   # summed over every paid attempt (re-asks cost tokens too); null:
                                     # the endpoint reported no usage (unknown, not zero)
    ("completion_tokens", pa.int64()),
    ("total_tokens", pa.int64()),
    ("cost_usd", pa.float64()),      # null when no price was given or the usage is unknown
    ("usage_complete", pa.bool_()),  # false: an attempt may have been billed without usage (a timeout, a
                                     # connection lost after sending): tokens and cost are unknown, not 0
    ("cached_tokens", pa.int64()),   # prompt tokens served from the provider's prefix cache (null: not reported)
    ("reasoning_tokens", pa.int64()),  # completion tokens spent on reasoning (null: not reported)
    ("batch_id", pa.string()),       # the provider batch that answered it (priced at the batch rate); "" real time
    ("cached", pa.bool_()),          # answered from the cache: nothing sent, nothing paid
    ("attempts", pa.int32()),        # HTTP requests sent for this logical request
    ("status", pa.string()),         # ok | error
    ("response_format", pa.string()),  # json_schema | json_object
    ("worker", pa.string()),         # host:pid of the actor that sent it
    ("time", pa.string()),
])


@dataclass(frozen=True)
class Prices:
    """USD per million tokens; ``None`` means unknown (cost left null rather than guessed). Cached prompt
    tokens (the provider's prefix cache) are billed at ``per_mtok_cached`` (``None``: at the input price)."""

    per_mtok_in: float | None = None
    per_mtok_out: float | None = None
    per_mtok_cached: float | None = None

    def scaled(self, factor: float) -> "Prices":
        """These prices times ``factor`` (a batch API's discount)."""
        return Prices(*(None if p is None else p * factor
                        for p in (self.per_mtok_in, self.per_mtok_out, self.per_mtok_cached)))

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> float | None:
        if self.per_mtok_in is None and self.per_mtok_out is None:
            return None
        cached = min(max(0, cached_tokens or 0), prompt_tokens) if self.per_mtok_cached is not None else 0
        return ((prompt_tokens - cached) * (self.per_mtok_in or 0.0) + cached * (self.per_mtok_cached or 0.0)
                + completion_tokens * (self.per_mtok_out or 0.0)) / 1e6


def summarize_usage(rows: list[dict]) -> dict:
    """Totals over usage rows (this run's): requests sent, cache hits, tokens, cost, by stage."""
    out: dict = {"logical_requests": 0, "http_requests": 0, "cached": 0, "errors": 0, "prompt_tokens": 0,
                 "completion_tokens": 0, "cost_usd": 0.0, "cost_known": False, "usage_unknown": 0, "batch": 0, "by_stage": {}}
    for r in rows:
        st = out["by_stage"].setdefault(r["stage"], {"requests": 0, "cached": 0, "prompt_tokens": 0,
                                                      "completion_tokens": 0, "cost_usd": 0.0})
        out["logical_requests"] += 1
        st["requests"] += 1
        out["http_requests"] += int(r.get("attempts") or 0)
        if r.get("cached"):
            out["cached"] += 1
            st["cached"] += 1
            continue
        if r.get("status") != "ok":
            out["errors"] += 1
        if r.get("prompt_tokens") is None or r.get("completion_tokens") is None or r.get("usage_complete") is False:
            out["usage_unknown"] += 1
        out["batch"] += bool(r.get("batch_id"))
        for k in ("prompt_tokens", "completion_tokens"):
            out[k] += int(r.get(k) or 0)
            st[k] += int(r.get(k) or 0)
        if r.get("cost_usd") is not None:
            out["cost_known"] = True
            out["cost_usd"] += r["cost_usd"]
            st["cost_usd"] += r["cost_usd"]
    return out


def format_summary(s: dict) -> str:
    cost = f"${s['cost_usd']:.4f}" if s["cost_known"] else "n/a (no --price-per-mtok-*)"
    if s.get("usage_unknown"):
        cost += (f" + unknown ({s['usage_unknown']} requests without usage from the endpoint, or timed out "
                 "after sending: the provider may have billed them)")
    unknown = " + unknown" if s.get("usage_unknown") else ""
    lines = [f"requests: {s['logical_requests']} logical, {s['http_requests']} sent over HTTP, "
             f"{s['cached']} answered from cache, {s['errors']} failed"
             + (f", {s['batch']} through provider batches (batch price)" if s.get("batch") else ""),
             f"tokens: {s['prompt_tokens']} prompt + {s['completion_tokens']} completion{unknown}; cost {cost}"]
    for name, st in sorted(s["by_stage"].items()):
        lines.append(f"  {name}: {st['requests']} requests ({st['cached']} cached), "
                     f"{st['prompt_tokens']}+{st['completion_tokens']} tokens")
    return "\n".join(lines)
