"""`decodekit models`: the embedded models and their measured figures (models/assets/registry.json),
and what `--dtype auto` does with a bfloat16 checkpoint on this CPU (models/dtype_probe.py)."""

from __future__ import annotations

import json


def add_models(sub) -> None:
    p = sub.add_parser("models", help="list the embedded models")
    p.add_argument("--json", action="store_true", help="print the registry as JSON")
    p.add_argument(
        "--dtype-report",
        action="store_true",
        help="only what --dtype auto gives each checkpoint dtype on this CPU, and the probe's "
        "timings behind it (JSON)",
    )
    p.set_defaults(run=run_models)


def run_models(args) -> None:
    from decodekit.models.registry import embedded_models

    if args.dtype_report:
        from decodekit.models.dtype_probe import dtype_report

        print(json.dumps(dtype_report(), indent=2))
        return
    models = embedded_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return
    print(f"{'name':<24} {'kind':<6} {'parameters':>11} {'size':>9}  measured")
    for name, entry in models.items():
        size = entry.get("size_bytes") or entry.get("size") or 0
        size_text = f"{size / 1e6:.1f} MB" if isinstance(size, int | float) else str(size)
        params = entry.get("parameters", "")
        params_text = f"{params:,}" if isinstance(params, int) else str(params)
        metric = entry.get("metric") or entry.get("metrics") or ""
        if isinstance(metric, dict):
            metric = ", ".join(f"{k}={v}" for k, v in metric.items())
        print(f"{name:<24} {entry.get('kind', 'hf'):<6} {params_text:>11} {size_text:>9}  {metric}")
    from decodekit.models.dtype_probe import dtype_report

    report = dtype_report()
    ratio = report["bf16_speed_vs_float32"]
    print(
        f"\n--dtype auto on this CPU: a bfloat16 checkpoint loads as {report['bfloat16_checkpoint']} "
        f"(bfloat16 decodes at {ratio['decode']}x float32, prefills at {ratio['prefill']}x; "
        "decodekit models --dtype-report); a half checkpoint run in float32 keeps its linear "
        f"weights {report['half_checkpoint_weights']}"
    )
