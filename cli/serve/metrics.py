"""/metrics: the engine's counters in Prometheus' text format under llama-server's metric names."""
from __future__ import annotations

from ggrun.core.llm.engine_loop import EngineLoop


def prometheus_text(engine: EngineLoop) -> str:
    """llama-server's metrics (tools/server/server.cpp): counters, then gauges, each with HELP and TYPE."""
    m = engine.metrics
    kv_used = engine.s.kv.n_used
    rows = [
        ("counter", "prompt_tokens_total", "Number of prompt tokens processed.", m.prompt_tokens),
        ("counter", "prompt_seconds_total", "Prompt process time", m.prompt_seconds),
        ("counter", "tokens_predicted_total", "Number of generation tokens processed.", m.tokens_predicted),
        ("counter", "tokens_predicted_seconds_total", "Predict process time", m.predicted_seconds),
        ("counter", "n_decode_total", "Total number of llama_decode() calls", m.n_decode),
        ("gauge", "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         m.n_busy_slots / m.n_decode if m.n_decode else 0.0),
        ("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
         m.prompt_tokens / m.prompt_seconds if m.prompt_seconds else 0.0),
        ("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s.",
         m.tokens_predicted / m.predicted_seconds if m.predicted_seconds else 0.0),
        ("gauge", "kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", kv_used / engine.s.n_ctx),
        ("gauge", "kv_cache_tokens", "KV-cache tokens.", kv_used),
        ("gauge", "requests_processing", "Number of requests processing.", engine.n_processing),
        ("gauge", "requests_deferred", "Number of requests deferred.", engine.n_deferred),
    ]
    out = []
    for kind, name, help_, value in rows:
        out += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return "\n".join(out) + "\n"
