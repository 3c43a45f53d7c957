"""`decodekit plan MODEL --context N --batch B`: weight and KV-cache bytes, and whether they fit
(models/footprint.py; seed 001's KV formula, with the KV heads of grouped-query attention)."""

from __future__ import annotations

import json

from decodekit.models.footprint import KV_BYTES


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="memory of a model's weights and KV cache, and whether they fit")
    p.add_argument("model", help="embedded model name or local checkpoint directory")
    p.add_argument("--context", type=int, required=True, help="positions per sequence (prompt + output)")
    p.add_argument("--batch", type=int, default=1, help="sequences held at once")
    p.add_argument("--kv-dtype", default="auto", metavar="DTYPE",
                   help=f"KV cache: auto (the weights' dtype), {', '.join(KV_BYTES)}")
    p.add_argument("--dtype", default="auto", metavar="DTYPE",
                   help="weights: auto (the checkpoint's), float32, bfloat16 or float16")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run_plan)


def run_plan(args) -> None:
    from decodekit.models.footprint import plan_memory

    plan = plan_memory(args.model, args.context, args.batch, args.kv_dtype, args.dtype)
    if args.json:
        print(json.dumps(plan))
        return
    fits = {True: "yes", False: "NO", None: "unknown"}[plan["fits"]]
    available = "unknown" if plan["available_bytes"] is None else gib(plan["available_bytes"])
    size = "compressed" if plan["parameters"] is None else f"{plan['parameters']:,} parameters"
    print(f"model      {plan['model']}: {size}, {plan['num_layers']} layers, "
          f"{plan['num_heads']} heads / {plan['num_kv_heads']} KV heads of {plan['head_dim']}")
    stored = "integer codes and scales, as stored" if plan["parameters"] is None else plan["dtype"]
    print(f"weights    {gib(plan['weight_bytes'])} ({stored})")
    print(f"KV cache   {gib(plan['kv_bytes'])} = {plan['kv_formula']} ({plan['kv_dtype']})")
    print(f"total      {gib(plan['total_bytes'])}")
    print(f"available  {available} ({plan['available_source']})")
    print(f"fits       {fits}")


def gib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.3f} GiB)"
