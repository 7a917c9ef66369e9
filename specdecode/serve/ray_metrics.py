"""Cluster metrics of `specdecode serve --replicas N`: each replica's Prometheus series with a
`replica` label, cluster-wide series, and the dashboard's `/api/stats` merged over replicas.

Input: {replica id: {"metrics": Prometheus text, "stats": /api/stats dict, "pid", "node"}} as
the replicas report it (ray_app.Registry)."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from .metrics import P


class _Collected:               # the families, as the collector generate_latest reads
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def _spec(stats: dict) -> dict:
    return stats.get("speculation") or {}


def cluster_metrics(reports: dict[str, dict]) -> bytes:
    """Every replica's series labelled `replica="<id>"` (one family per metric name), then
    `specdecode:cluster_*`: replicas reporting, acceptance rate (accepted / drafted tokens over
    all replicas), generated tokens per second, requests running and waiting (sums)."""
    merged: dict[str, Metric] = {}
    for replica, report in sorted(reports.items()):
        for family in text_string_to_metric_families(report["metrics"]):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, dict(s.labels, replica=replica), s.value, s.timestamp, s.exemplar)
    stats = [r["stats"] for r in reports.values()]
    drafted = sum(_spec(s).get("drafted_tokens", 0) for s in stats)
    accepted = sum(_spec(s).get("accepted_tokens", 0) for s in stats)
    cluster = [
        (P + "cluster_replicas", "Replicas reporting metrics", len(reports)),
        (P + "cluster_spec_decode_acceptance_rate", "Accepted / drafted tokens over all replicas",
         accepted / drafted if drafted else 0.0),
        (P + "cluster_generation_tokens_per_second", "Generated tokens per second, all replicas",
         sum(s.get("throughput_tokens_per_s", 0.0) for s in stats)),
        (P + "cluster_num_requests_running", "Requests in the replicas' batches",
         sum(s.get("requests", {}).get("running", 0) for s in stats)),
        (P + "cluster_num_requests_waiting", "Requests queued in the replicas",
         sum(s.get("requests", {}).get("waiting", 0) for s in stats)),
    ]
    families = list(merged.values()) + [GaugeMetricFamily(name, doc, value=value) for name, doc, value in cluster]
    return generate_latest(_Collected(families))


def _sum_dicts(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _merge_history(histories: list[list[dict]]) -> list[dict]:
    """Per-second points aligned from the newest: rates and counts summed, acceptance averaged."""
    length = max((len(h) for h in histories), default=0)
    points = []
    for back in range(length, 0, -1):
        row = [h[len(h) - back] for h in histories if len(h) >= back]
        points.append({"t": max(p["t"] for p in row),
                       "tokens_per_s": round(sum(p["tokens_per_s"] for p in row), 3),
                       "acceptance_rate": round(sum(p["acceptance_rate"] for p in row) / len(row), 4),
                       "mean_accepted_length": round(sum(p["mean_accepted_length"] for p in row) / len(row), 4),
                       "running": sum(p["running"] for p in row), "waiting": sum(p["waiting"] for p in row)})
    return points


def cluster_stats(reports: dict[str, dict]) -> dict:
    """The dashboard's /api/stats over all replicas (counts and rates summed, acceptance from the
    summed tokens) plus `replicas`: one summary per replica."""
    if not reports:
        return {"replicas": []}
    ids = sorted(reports)
    stats = [reports[i]["stats"] for i in ids]
    specs = [_spec(s) for s in stats]
    first = stats[0]
    drafted = sum(s.get("drafted_tokens", 0) for s in specs)
    accepted = sum(s.get("accepted_tokens", 0) for s in specs)
    steps = sum(s.get("steps", 0) for s in specs)
    generated = sum(s.get("generated_tokens", 0) for s in stats)
    positions = max((len(s.get("acceptance_per_position", [])) for s in specs), default=0)
    per_pos = [[s["acceptance_per_position"][i] for s in specs if len(s.get("acceptance_per_position", [])) > i]
               for i in range(positions)]
    trees = [s.get("last_tree") for s in specs if s.get("last_tree")]
    speculation = dict(_spec(first))
    speculation.update(
        requests_on=sum(s.get("requests_on", 0) for s in specs),
        batch_auto_off=any(s.get("batch_auto_off") for s in specs),
        acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
        mean_accepted_length=round(sum(s.get("mean_accepted_length", 0) * s.get("steps", 0) for s in specs) / steps, 4)
        if steps else 0.0,
        tokens_per_step=round(generated / steps, 4) if steps else 0.0,
        acceptance_per_position=[round(sum(v) / len(v), 4) for v in per_pos],
        tree_nodes_histogram=_sum_dicts([s.get("tree_nodes_histogram", {}) for s in specs]),
        last_tree=max(trees, key=lambda t: t["t"]) if trees else None,
        draft_s=round(sum(s.get("draft_s", 0) for s in specs), 4),
        verify_s=round(sum(s.get("verify_s", 0) for s in specs), 4),
        drafted_tokens=drafted, accepted_tokens=accepted, steps=steps)
    memory = {key: _sum_dicts([s.get("memory", {}).get(key, {}) for s in stats])
              for key in ("weights_bytes", "kv_bytes_used", "kv_bytes_capacity")}
    return {
        "model": first.get("model"), "method": first.get("method"),
        "uptime_s": max(s.get("uptime_s", 0) for s in stats),
        "requests": _sum_dicts([s.get("requests", {}) for s in stats]),
        "speculation": speculation,
        "throughput_tokens_per_s": round(sum(s.get("throughput_tokens_per_s", 0) for s in stats), 3),
        "generated_tokens": generated, "memory": memory,
        "history": _merge_history([s.get("history", []) for s in stats]),
        "replicas": [{"replica": i, "pid": reports[i].get("pid"), "node": reports[i].get("node"),
                      "throughput_tokens_per_s": s.get("throughput_tokens_per_s", 0),
                      "acceptance_rate": _spec(s).get("acceptance_rate", 0.0),
                      "running": s.get("requests", {}).get("running", 0),
                      "waiting": s.get("requests", {}).get("waiting", 0),
                      "finished": s.get("requests", {}).get("finished", 0)} for i, s in zip(ids, stats)],
    }
