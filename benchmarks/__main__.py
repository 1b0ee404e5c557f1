"""`python -m benchmarks [--quick] [--suites ...] [--depths 12 24 ...]`: run, write the results.

Suites: `quality` (our plans against what experts write with `jax.jit` shardings, for realistic
and small models, each program compiled for 8 simulated devices and judged on GPU and TPU
profiles by `autopar.evaluate`), `fidelity` (the cost model's estimates against what XLA compiled,
with pinned baselines, for small models run on the simulated devices), `propagation`
(annotations spread by sharding_propagation against the search), `planning` (search time and
quality at depth and scale, first call against jax.jit), `memory` (plans for shrinking memory
budgets, predicted against compiled memory), `accumulation` (microbatched steps: the
gradient reduced once or per microbatch, predicted against compiled collectives and memory)
and `pipeline` (a GPT's layer stack over 1 to 8 pipeline stages, predicted against compiled;
what pipeline="auto" keeps as the network between nodes slows); `device`, run by default only
where jax's first device is an accelerator, measures the realistic models' steps on one chip
beside their judged and estimated times.
`tpu` sets our plans against MaxText-style experts on TPU slices of 64 to 512 chips, every
program compiled by the TPU compiler (libtpu's compile-only topologies) and judged by
benchmarks/judge.py, which shares no code with the planner; `gpu` does the same on one node of 8
GPUs, mocked over one real GPU (benchmarks/gpu_suite.py says how to start it).
Results go to benchmarks/results/<suite>.md and .json, with the machine and versions, replacing
the suite's previous results (quality's with --memory-matched add the memory-matched table).
Timings are of this machine; compare them as ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import jax  # noqa: E402

if os.environ.get("JAX_MOCK_GPU_TOPOLOGY"):  # the gpu suite's mock node (gpu_suite.py)
    jax.config.update("jax_mock_gpu_topology", os.environ["JAX_MOCK_GPU_TOPOLOGY"])
    jax.config.update("jax_cuda_visible_devices", os.environ.get("JAX_CUDA_VISIBLE_DEVICES", "0"))

from benchmarks import (accumulation, device, fidelity, memory, pipeline,  # noqa: E402
                        gpu_suite, planning, propagation, quality, quality_report,
                        tpu_suite)
from benchmarks.zoo import ZOO  # noqa: E402

TITLES = {"quality": "Plan quality against expert shardings, judged from compiled programs",
          "fidelity": "Cost-model fidelity against compiled programs",
          "propagation": "Sharding propagation benchmark", "planning": "Planning benchmark",
          "memory": "Memory-aware planning benchmark",
          "accumulation": "Gradient accumulation: reduced once, predicted against compiled",
          "pipeline": "Pipeline parallelism: stages predicted against compiled",
          "device": "One real accelerator: measured step times beside the judged ones",
          "tpu": "TPU slices: our plans against MaxText-style experts, compiled by the TPU "
                 "compiler and judged independently",
          "gpu": "One node of 8 GPUs: our plans against MaxText-style experts, compiled by "
                 "XLA's GPU compiler (a mock topology over one GPU) and judged independently"}
# Suites run by default; `device` needs an accelerator and runs where one is at hand; `gpu`
# needs one GPU started as a mock node (benchmarks/gpu_suite.py), so it is asked for by name.
DEFAULT_SUITES = [s for s in TITLES if s != "gpu"
                  and (s != "device" or jax.devices()[0].platform != "cpu")]


def machine() -> dict[str, str]:
    return {"python": platform.python_version(), "jax": jax.__version__,
            "platform": platform.platform(), "processor": platform.machine(),
            "cpus": str(os.cpu_count()), "devices": f"{len(jax.devices())} x "
            f"{jax.devices()[0].device_kind}", "autopar": revision()}


def revision() -> str:
    """The commit autopar was run at, and whether autopar/ had changes on top: results of
    different plans are only comparable knowing which code made them."""
    root = os.path.join(os.path.dirname(__file__), "..")
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "autopar"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes to autopar/" if dirty else "")


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
    parser.add_argument("--suites", nargs="+", default=DEFAULT_SUITES, choices=list(TITLES))
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"quality suite: models of {list(ZOO)} (default all); fidelity "
                        f"suite: of {list(fidelity.MODELS)} (default all)")
    parser.add_argument("--meshes", nargs="+", default=None,
                        help="quality and fidelity suites: meshes like 2x4 (axes data, model, "
                        f"inner) over jax.devices() (defaults {list(quality.MESHES)} and "
                        f"{list(fidelity.MESHES)})")
    parser.add_argument("--profiles", nargs="+", default=list(quality.PROFILES),
                        help="quality suite: hardware profiles the plans are made and judged for")
    parser.add_argument("--searches", nargs="+", default=list(quality.SEARCHES),
                        help="quality suite: our searches")
    parser.add_argument("--memory-matched", action="store_true",
                        help="quality suite: also plan ours with memory_limit = the best "
                        "expert's compiled memory (one more plan and compile per case)")
    parser.add_argument("--scale", type=int, default=1,
                        help="fidelity suite: batch and width of every model times this")
    parser.add_argument("--repeats", type=int, default=3,
                        help="quality and fidelity suites: timed steps of the small models")
    parser.add_argument("--experts-from", default=None,
                        help="tpu and gpu suites: a tpu.json or gpu.json whose expert rows "
                        "are kept (only ours is planned and compiled again)")
    parser.add_argument("--hlo-dir", default=None,
                        help="device suite: write each program compiled for the chip here")
    args = parser.parse_args()
    if args.quick:
        args.depths, args.d_model, args.seq, args.batch = [2, 4], 128, 32, 64
        args.models, args.meshes = ["mlp-wide", "gpt-small"], ["2x4"]
        args.profiles, args.repeats = ["h100"], 1
    for suite in args.suites:
        if suite == "quality":
            names = args.models or list(ZOO)
            meshes = args.meshes or list(quality.MESHES)
            print(f"quality benchmark: models {names}, meshes {meshes}, profiles "
                  f"{args.profiles}, searches {args.searches}", flush=True)
            result = quality.run(_known(names, ZOO), meshes, tuple(args.profiles),
                                 tuple(args.searches), args.memory_matched, args.repeats,
                                 log=log)
            table = quality_report.markdown(result)
        elif suite == "fidelity":
            names = args.models or list(fidelity.MODELS)
            meshes = args.meshes or list(fidelity.MESHES)
            print(f"fidelity benchmark: models {names}, meshes {meshes}", flush=True)
            result = fidelity.run(_known(names, fidelity.MODELS), meshes, args.repeats,
                                  log=log, scale=args.scale)
            table = fidelity.markdown(result)
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
        elif suite == "accumulation":
            print("accumulation benchmark", flush=True)
            result = accumulation.run(log=log)
            table = accumulation.markdown(result)
        elif suite == "device":
            print(f"device benchmark on {jax.devices()[0].device_kind}", flush=True)
            result = device.run(args.models and _known(args.models, device.REALISTIC),
                                args.hardware, log=log, hlo_dir=args.hlo_dir)
            table = device.markdown(result)
        elif suite in ("tpu", "gpu"):
            # the gpu suite is the tpu suite's on a mock GPU node, all of it memory-matched
            cases = (gpu_suite.CASES if suite == "gpu" else
                     tpu_suite.QUICK if args.quick else tpu_suite.CASES)
            names = [m for m in args.models or () if m in cases] or list(cases)
            print(f"{suite} benchmark: cases {names}", flush=True)
            kept = None
            if args.experts_from:
                with open(args.experts_from) as f:
                    kept = json.load(f)
            chosen = {n: cases[n] for n in _known(names, cases)}
            result = (gpu_suite.run(chosen, log=log, experts_from=kept) if suite == "gpu" else
                      tpu_suite.run(chosen, args.memory_matched, log=log, experts_from=kept))
            table = tpu_suite.markdown(result)
        elif suite == "pipeline":
            print("pipeline benchmark", flush=True)
            result = {**pipeline.run(log=log), **pipeline.choice(log=log),
                      **pipeline.choice_within(log=log)}
            table = (pipeline.markdown(result) + "\n" + pipeline.choice_markdown(result)
                     + "\n" + pipeline.within_markdown(result))
        else:
            print("sharding propagation benchmark", flush=True)
            cases = propagation.QUICK_CASES if args.quick else propagation.CASES
            result = propagation.run(cases, log=log)
            table = propagation.markdown(result)
        write(suite, result, table, args)


def _known(names: list[str], known: dict) -> list[str]:
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; this suite has {list(known)}")
    return names


def write(suite: str, result: dict, table: str, args: argparse.Namespace) -> None:
    result["machine"] = machine()
    result["arguments"] = vars(args)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, suite)
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
