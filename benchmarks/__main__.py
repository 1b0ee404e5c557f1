"""`python -m benchmarks [--quick] [--suites ...] [--depths 12 24 ...]`: run, write the results.

Suites: `quality` (our plans against hand-written ones on small models and 8 simulated devices,
with what XLA compiled of each), `propagation` (annotations spread by sharding_propagation
against the search) and `planning` (search time and quality at depth and scale, overhead
against jax.jit) and `memory` (plans for shrinking memory budgets, predicted against compiled
memory).
Results go to benchmarks/results/<date>-<suite>.md and .json, with the machine and versions.
Timings are of this machine; compare them as ratios within one run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import jax  # noqa: E402

from benchmarks import memory, planning, propagation, quality  # noqa: E402

TITLES = {"quality": "Plan quality and cost-model fidelity",
          "propagation": "Sharding propagation benchmark", "planning": "Planning benchmark",
          "memory": "Memory-aware planning benchmark"}


def machine() -> dict[str, str]:
    return {"python": platform.python_version(), "jax": jax.__version__,
            "platform": platform.platform(), "processor": platform.machine(),
            "cpus": str(os.cpu_count()), "devices": f"{len(jax.devices())} x "
            f"{jax.devices()[0].device_kind}"}


def log(line: str) -> None:
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small depths, for a smoke run")
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 24, 48, 96])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dp-max-layers", type=int, default=96,
                        help="skip dynamic_programming above this depth")
    parser.add_argument("--hardware", default="h100", help="profile the plans are costed on")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--suites", nargs="+", default=list(TITLES), choices=list(TITLES))
    parser.add_argument("--models", nargs="+", default=list(quality.MODELS),
                        choices=list(quality.MODELS), help="quality suite: models")
    parser.add_argument("--meshes", nargs="+", default=list(quality.MESHES),
                        help="quality suite: meshes like 2x4 (axes data, model, inner) over "
                        "jax.devices(): real devices where there are any")
    parser.add_argument("--scale", type=int, default=1,
                        help="quality suite: batch and width of every model times this")
    parser.add_argument("--repeats", type=int, default=3, help="quality suite: timed steps")
    args = parser.parse_args()
    if args.quick:
        args.depths, args.d_model, args.seq, args.batch = [2, 4], 128, 32, 64
        args.models, args.meshes = ["mlp-wide", "gpt-small"], ["2x4"]
    for suite in args.suites:
        if suite == "quality":
            print(f"quality benchmark: models {args.models}, meshes {args.meshes}", flush=True)
            result = quality.run(args.models, args.meshes, args.repeats, log=log,
                                 scale=args.scale)
            table = quality.markdown(result)
        elif suite == "planning":
            print(f"planning benchmark: depths {args.depths}, devices {args.devices}, "
                  f"d_model {args.d_model}, hardware {args.hardware}", flush=True)
            result = planning.run(args.depths, args.devices, args.d_model, args.seq,
                                  args.batch, args.dp_max_layers, args.hardware, log=log)
            table = planning.markdown(result)
        elif suite == "memory":
            print("memory benchmark", flush=True)
            cases = {"mlp": memory.CASES["mlp"]} if args.quick else memory.CASES
            fractions = (1.0, 0.25, 0.03) if args.quick else memory.FRACTIONS
            result = memory.run(cases, {"data": 8}, fractions, log=log)
            table = memory.markdown(result)
        else:
            print("sharding propagation benchmark", flush=True)
            cases = propagation.QUICK_CASES if args.quick else propagation.CASES
            result = propagation.run(cases, log=log)
            table = propagation.markdown(result)
        write(suite, result, table, args)


def write(suite: str, result: dict, table: str, args: argparse.Namespace) -> None:
    result["machine"] = machine()
    result["arguments"] = vars(args)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"{stamp}-{suite}")
    header = f"# {TITLES[suite]}\n\n" + "\n".join(f"- {k}: {v}"
                                                   for k, v in result["machine"].items())
    with open(base + ".md", "w") as f:
        f.write(header + "\n\n" + table + "\n")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(table)
    print(f"\nwritten: {base}.md, {base}.json")


if __name__ == "__main__":
    main()
