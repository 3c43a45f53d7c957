"""`decodekit models`: the embedded models and their measured figures (models/assets/registry.json)."""

from __future__ import annotations

import json


def add_models(sub) -> None:
    p = sub.add_parser("models", help="list the embedded models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_models)


def run_models(args) -> None:
    from decodekit.models.registry import embedded_models

    models = embedded_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return
    print(f"{'name':<20} {'kind':<6} {'parameters':>11} {'size':>9}  measured")
    for name, entry in models.items():
        size = entry.get("size_bytes") or entry.get("size") or 0
        size_text = f"{size / 1e6:.1f} MB" if isinstance(size, int | float) else str(size)
        params = entry.get("parameters", "")
        params_text = f"{params:,}" if isinstance(params, int) else str(params)
        metric = entry.get("metric") or entry.get("metrics") or ""
        if isinstance(metric, dict):
            metric = ", ".join(f"{k}={v}" for k, v in metric.items())
        print(f"{name:<20} {entry.get('kind', 'hf'):<6} {params_text:>11} {size_text:>9}  {metric}")
