"""The Grafana dashboard (infra/grafana/dspark_serve.json) charts only metrics the Serve app
exports, under the names Prometheus sees (Ray's ``ray_`` prefix, ``_total`` on counters,
``_bucket`` on histograms)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def exported_names() -> set[str]:
    """Prometheus names of the metrics serve/app_metrics.py defines (parsed, not imported: no
    Ray)."""
    src = (ROOT / "serve" / "app_metrics.py").read_text()
    names = set()
    for kind, name in re.findall(r'm\.(Counter|Histogram|Gauge)\(\s*"(\w+)"', src):
        base = f"ray_{name}"
        names |= {f"{base}_total"} if kind == "Counter" else (
            {f"{base}_bucket", f"{base}_count", f"{base}_sum"} if kind == "Histogram" else {base})
    counters = re.search(r"COUNTERS = \{(.*?)\}", src, re.S).group(1)
    names |= {f"ray_{n}_total" for n in re.findall(r':\s*"(\w+)"', counters)}
    return names


def test_dashboard_queries_only_exported_metrics():
    dash = json.loads((ROOT / "infra" / "grafana" / "dspark_serve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bray_\w+", e)}
    known = exported_names()
    assert used and used <= known, sorted(used - known)
    # the vLLM-named speculative-decoding counters are charted
    assert {"ray_vllm_spec_decode_num_draft_tokens_total",
            "ray_vllm_spec_decode_num_accepted_tokens_total"} <= used
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
