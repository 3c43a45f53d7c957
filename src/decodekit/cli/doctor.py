"""`decodekit doctor`: versions, devices, CPU flags, kernels, cache directory and extras, and
for each missing piece one line saying what it costs (environment.py). Changes nothing: the
kernels are reported, never built."""

from __future__ import annotations

import json


def add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="what decodekit finds here (versions, devices, kernels, extras) "
                                      "and what each missing piece costs")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run_doctor)


def run_doctor(args) -> None:
    from decodekit.environment import report

    facts = report()
    if args.json:
        print(json.dumps(facts, indent=2))
        return
    versions = facts["versions"]
    cpu, kernels = facts["cpu"], facts["kernels"]
    print(f"decodekit     {versions['decodekit'] or 'not installed (sources on the path)'} "
          f"({facts['decodekit_path']})")
    print(f"python        {versions['python']} ({facts['python_path']})")
    print(f"torch         {versions['torch']}")
    print(f"transformers  {versions['transformers'] or 'not installed'}")
    print(f"cpu           {cpu['name']} ({cpu['machine']}), {cpu['cores']} cores usable")
    if cpu["flags"] is not None:
        have = [flag for flag, present in cpu["flags"].items() if present]
        lacks = [flag for flag, present in cpu["flags"].items() if not present]
        lacking = f"; lacks {' '.join(lacks)}" if lacks else ""
        print(f"cpu flags     {' '.join(have) or 'none the kernels use'}{lacking}")
    cuda = ", ".join(facts["cuda"]) or f"none (torch CUDA build: {facts['cuda_build'] or 'no'})"
    print(f"cuda          {cuda}")
    print(f"kernels       {'available' if kernels['available'] else 'unavailable'} ({kernels['reason']})")
    if kernels["library"]:
        print(f"              {kernels['library']}")
    if kernels["activation_quantised"]:
        print(f"              W8A8 / W4A8 (activation_bits=8): {kernels['activation_quantised']}")
    print(f"compiler      {kernels['compiler'] or 'none'}")
    print(f"cache         {facts['cache_dir']} (DECODEKIT_CACHE_DIR moves it)")
    print(f"huge pages    {facts['huge_pages']}")
    for extra, entry in facts["extras"].items():
        packages = ", ".join(f"{name} {version or '(missing)'}" for name, version in
                             entry["packages"].items())
        print(f"extra         [{extra}] {'yes' if entry['installed'] else 'NO'}: {packages}")
    if facts["missing"]:
        print("\nmissing, and what it costs:")
        for line in facts["missing"]:
            print(f"- {line}")
    else:
        print("\nnothing missing")
