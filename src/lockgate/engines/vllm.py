"""vLLM's OpenAI-compatible server.

Aborts a request when its connection closes; accepts `priority` (with `--scheduling-policy priority`),
`continue_final_message` for assistant-prefix continuation and `cache_salt` (prefix-cache blocks kept apart by it).
"""

from .base import Dialect, MetricNames

VLLM = Dialect(
    name="vllm",
    health_path="/health",
    metrics=MetricNames(
        waiting=("vllm:num_requests_waiting",),
        running=("vllm:num_requests_running",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        prefix_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        prefix_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        tpot_seconds=("vllm:time_per_output_token_seconds_sum", "vllm:inter_token_latency_seconds_sum"),
        tpot_tokens=("vllm:time_per_output_token_seconds_count", "vllm:inter_token_latency_seconds_count"),
        cache_info=("vllm:cache_config_info",),
    ),
    priority_field="priority",
    continue_final_message=True,
    cache_salt=True,
)
