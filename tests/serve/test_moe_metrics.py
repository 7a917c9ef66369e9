"""The Prometheus series of a mixture-of-experts target's passes (serve/metrics.py: record_experts)."""
from prometheus_client import generate_latest

from specdecode.serve.metrics import ServeMetrics


def test_moe_passes_their_rows_and_distinct_experts_are_exposed():
    metrics = ServeMetrics("moe", "ngram", 4, {"target": 1, "draft": 0}, {"target": None, "draft": None})
    metrics.record_experts(1, 8.0)
    metrics.record_experts(5, 33.5)
    text = generate_latest(metrics.registry).decode()
    assert "specdecode:moe_passes_total 2.0" in text
    assert "specdecode:moe_pass_rows_total 6.0" in text
    assert "specdecode:moe_experts_total 41.5" in text
    assert 'specdecode:moe_experts_per_pass_bucket{le="8.0"} 1.0' in text
    assert 'specdecode:moe_experts_per_pass_bucket{le="48.0"} 2.0' in text
