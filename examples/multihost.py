"""Train a small GPT with autopar in 2 processes of 4 CPU devices each, on localhost.

    python examples/multihost.py            # starts the 2 processes and waits for them

Each process is what one host of a cluster runs: it joins JAX's distributed runtime
(`jax.distributed.initialize`), builds the same 2 x 4 mesh over all 8 devices, loads only its
own rows of every batch (`autopar.process_rows`), makes the global batch
(`autopar.global_batch`) and calls the same decorated step. autopar plans in every process and
checks that the plans agree. After training, the state is saved as a sharded checkpoint (each
process writes its shards) and restored into the plan of a 4 x 2 mesh, and the links of the
mesh's axes are measured (`autopar.calibrate`; every process gets the same numbers).

`--differ shape` or `--differ values` makes process 1 pass a different batch, to show the error
every process then raises. `--out DIR` writes each process's results there (the tests read them).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

STEPS = 3
PROCESSES, LOCAL_DEVICES = 2, 4


def launch(argv: list[str], timeout: float = 60) -> int:
    """Start the processes on a free local port, each allowed `timeout` seconds; the exit
    status of the first that fails (124: timed out)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Each process sets its own count of CPU devices; the other XLA flags pass through.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, __file__, "--process-id", str(i), "--port",
                               str(port), *argv],
                              env={**env, "PYTHONHASHSEED": str(i + 1)})  # planning ignores it
             for i in range(PROCESSES)]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(124)
    return next((c for c in codes if c), 0)


def worker(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    t0 = time.perf_counter()
    jax.distributed.initialize(f"127.0.0.1:{args.port}", PROCESSES, args.process_id)
    sys.path.insert(0, os.path.dirname(__file__))
    import models
    import numpy as np
    from jax.experimental import multihost_utils

    import autopar

    step, state, batch = models.gpt_setup(batch=16, seq=16, vocab=128, d_model=32, heads=4,
                                          layers=2)
    if args.differ == "shape" and args.process_id == 1:
        batch = jax.tree.map(lambda x: x[:8], batch)
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    train_step = autopar.auto_parallel(step, mesh=mesh, donate_argnums=0)
    out: dict = {"process": jax.process_index(), "devices": jax.device_count()}
    try:
        # the batch's layout under the plan; each process loads only its rows of it
        shardings = train_step.input_shardings(state, batch)[0][1]
        leaf = jax.tree.leaves(shardings)[0]
        rows = autopar.process_rows(leaf, len(jax.tree.leaves(batch)[0]))
        local = jax.tree.map(lambda x: np.asarray(x)[rows], batch)
        if args.differ == "values":
            if args.process_id == 1:
                batch = jax.tree.map(lambda x: np.asarray(x) + 1, batch)
            global_batch = batch  # a host value: it must be the same on every process
        else:
            global_batch = autopar.global_batch(local, shardings)
        losses = []
        for _ in range(STEPS):
            state, loss = train_step(state, global_batch)
            losses.append(float(loss))
    except autopar.AutoparError as e:
        print(f"process {args.process_id}: AutoparError: {e}", flush=True)
        _write(args, {**out, "error": str(e)})
        return 3
    plan = train_step.plan(state, global_batch)
    out.update(losses=losses, rows=[rows.start, rows.stop], seconds=time.perf_counter() - t0,
               plan_json=plan.to_json())

    ckpt = os.path.join(args.out or "plans", "multihost_checkpoint")
    t = time.perf_counter()
    autopar.save_checkpoint(ckpt, state, plan, overwrite=True)
    out["save_s"] = time.perf_counter() - t
    other = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 4, "model": 2}),
                                  donate_argnums=0)
    t = time.perf_counter()
    restored = autopar.restore_checkpoint(ckpt, state,
                                          other.input_shardings(state, global_batch)[0][0])
    out["restore_s"] = time.perf_counter() - t
    gathered = multihost_utils.process_allgather(state, tiled=True)
    again = multihost_utils.process_allgather(restored, tiled=True)
    out["restored_equal"] = all(np.array_equal(a, b) for a, b in
                                zip(jax.tree.leaves(gathered), jax.tree.leaves(again)))
    # links measured per mesh axis: the data axis crosses the processes, the model axis not
    hw = autopar.calibrate(mesh, sizes=(2**12, 2**16, 2**20), repeats=2, progress=False)
    out["calibrated"] = hw.to_json()
    _write(args, out, jax.tree.leaves(gathered))
    if autopar.is_main_process():
        links = ", ".join(f"{level.name} alpha {level.latency * 1e6:.0f} us, beta "
                          f"{level.bandwidth / 1e9:.2f} GB/s" for level in hw.levels)
        print(f"calibrated links: {links}")
        print(f"{PROCESSES} processes x {LOCAL_DEVICES} devices: losses "
              f"{', '.join(f'{x:.4f}' for x in losses)}; this process loaded rows "
              f"{rows.start}-{rows.stop - 1} of each batch; plans agree; "
              f"{out['seconds']:.1f} s from start to trained")
        print(f"checkpoint saved in {out['save_s']:.2f} s, restored into a 4 x 2 plan in "
              f"{out['restore_s']:.2f} s (equal: {out['restored_equal']})")
    return 0


def _write(args: argparse.Namespace, out: dict, state: list | None = None) -> None:
    if not args.out:
        return
    import numpy as np
    with open(os.path.join(args.out, f"process_{args.process_id}.json"), "w") as f:
        json.dump(out, f)
    if state is not None:
        np.savez(os.path.join(args.out, f"state_{args.process_id}.npz"), *state)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--differ", choices=["shape", "values"])
    parser.add_argument("--out")
    args, _ = parser.parse_known_args()
    if args.process_id is None:
        return launch(sys.argv[1:])
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
