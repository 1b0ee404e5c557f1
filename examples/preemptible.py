"""A training job that survives preemption: 2 processes of 2 CPU devices each, on localhost.

    python examples/preemptible.py       # trains, is preempted, resumes, and checks the result

Each process runs the same loop. It resumes from the newest complete checkpoint in `--dir`
(`autopar.latest_checkpoint`) and asks `autopar.Preemption` after every step whether to stop;
when a SIGTERM has reached any process, all of them stop at the same step, save a checkpoint of
it and exit 0. The launcher sends process 1 a SIGTERM once it has finished step
`--sigterm-after`, waits for both processes, then starts them again: they resume where the
first run stopped and train to `--steps`. With `--check`, each process then trains the same
steps again uninterrupted, from the first state, and compares: losses and state are equal to
the bit.

`--sigkill-after N` kills process 1 instead (no checkpoint): the survivor stops within
`--heartbeat` seconds, JAX's coordination service ending it with "another task died" in its
log, rather than waiting forever in its next collective.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

PROCESSES, LOCAL_DEVICES = 2, 2


def launch(args: argparse.Namespace, after: int | None, sig: int, timeout: float = 120
           ) -> tuple[list[int | None], float | None]:
    """Start the processes; send process 1 `sig` once it reports step `after` done. Their exit
    codes (None: still running at `timeout`, then killed), and the seconds from the signal to
    the last exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Each process sets its own count of CPU devices; the other XLA flags pass through.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, __file__, "--port", str(port), "--dir", args.dir, "--out", args.out,
            "--steps", str(args.steps), "--heartbeat", str(args.heartbeat),
            "--step-seconds", str(args.step_seconds)]
    argv += ["--check"] if args.check else []
    procs = [subprocess.Popen([*argv, "--process-id", str(i)], env=env,
                              stderr=open(os.path.join(args.out, f"stderr_{i}.txt"), "w"))
             for i in range(PROCESSES)]
    sent, deadline = None, time.monotonic() + timeout
    progress = os.path.join(args.out, "progress_1")
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if after is not None and sent is None and _done_step(progress) >= after:
            procs[1].send_signal(sig)
            sent = time.monotonic()
        time.sleep(0.02)
    stopped = time.monotonic() - sent if sent is not None else None
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
    return codes, stopped


def _done_step(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read() or -1)
    except (OSError, ValueError):
        return -1


def worker(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", PROCESSES, args.process_id,
                               heartbeat_timeout_seconds=args.heartbeat)
    sys.path.insert(0, os.path.dirname(__file__))
    import models
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    import autopar

    config = dict(vocab=128, d_model=32, heads=4, layers=2)
    step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3))

    def host_batch(n: int) -> dict:  # the same on every process, a new one every step
        rng = np.random.default_rng(n)
        return {k: rng.integers(0, 128, (16, 16), dtype=np.int32) for k in ("inputs", "targets")}

    def init() -> Any:  # parameters and optimizer state
        return models.gpt_setup(batch=16, seq=16, **config)[1]

    train_step = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 2, "model": 2}))
    abstract = jax.eval_shape(init)
    layout, batch_layout = train_step.input_shardings(abstract, host_batch(0))[0]

    def batch_of(n: int) -> dict:  # each process places its devices' pieces
        return jax.device_put(host_batch(n), batch_layout)

    first_state = jax.jit(init, out_shardings=layout)  # made sharded, where the plan wants it
    state, start = first_state(), 0
    found = autopar.latest_checkpoint(args.dir)
    if found is not None:
        start, path = found
        state = autopar.restore_checkpoint(path, abstract, layout)
    preemption, losses, stopped = autopar.Preemption(), [], None
    for n in range(start, args.steps):
        state, loss = train_step(state, batch_of(n))
        losses.append(float(loss))
        time.sleep(args.step_seconds)  # a real step's time: JAX notices a SIGTERM within 1 s
        with open(os.path.join(args.out, f"progress_{args.process_id}"), "w") as f:
            f.write(str(n))
        if preemption.reached(n):
            path = os.path.join(args.dir, f"step_{n + 1}")
            autopar.save_checkpoint(path, state, train_step.plan(state, batch_of(n)))
            stopped = n + 1
            break
    out = {"start": start, "stopped_at": stopped, "losses": losses}
    if args.check and stopped is None:  # the same steps uninterrupted, from the first state
        again, expected = first_state(), []
        for n in range(args.steps):
            again, loss = train_step(again, batch_of(n))
            expected.append(float(loss))
        out["uninterrupted_losses"] = expected
        mine, theirs = (multihost_utils.process_allgather(x, tiled=True) for x in (state, again))
        out["state_equal"] = all(np.array_equal(a, b) for a, b in
                                 zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)))
    with open(os.path.join(args.out, f"process_{args.process_id}.json"), "w") as f:
        json.dump(out, f)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--dir", help="where the checkpoints go (default: a new temporary one)")
    parser.add_argument("--out", help="where each process writes its results")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--sigterm-after", type=int, default=1)
    parser.add_argument("--sigkill-after", type=int)
    parser.add_argument("--heartbeat", type=int, default=10,
                        help="seconds without a process's heartbeat before the others stop")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.process_id is not None:
        return worker(args)
    args.dir = args.dir or tempfile.mkdtemp(prefix="autopar-preemptible-")
    args.out = args.out or args.dir
    if args.sigkill_after is not None:
        codes, stopped = launch(args, args.sigkill_after, signal.SIGKILL)
        with open(os.path.join(args.out, "killed.json"), "w") as f:
            json.dump({"exit_codes": codes, "stopped_s": stopped}, f)
        print(f"process 1 killed after step {args.sigkill_after}; exit codes {codes}; the "
              f"survivor stopped {stopped:.1f} s later (heartbeat {args.heartbeat} s)")
        return 0 if codes[0] not in (0, None) else 1
    codes, _ = launch(args, args.sigterm_after, signal.SIGTERM)
    first = []
    for i in range(PROCESSES):  # kept beside the resumed run's results
        os.replace(os.path.join(args.out, f"process_{i}.json"),
                   os.path.join(args.out, f"preempted_{i}.json"))
        with open(os.path.join(args.out, f"preempted_{i}.json")) as f:
            first.append(json.load(f))
    print(f"preempted: exit codes {codes}, both stopped and saved at step "
          f"{[r['stopped_at'] for r in first]}")
    args.check = True
    codes, _ = launch(args, None, signal.SIGTERM)
    resumed = []
    for i in range(PROCESSES):
        with open(os.path.join(args.out, f"process_{i}.json")) as f:
            resumed.append(json.load(f))
    losses = first[0]["losses"] + resumed[0]["losses"]
    same = losses == resumed[0]["uninterrupted_losses"] and resumed[0]["state_equal"]
    print(f"resumed from step {resumed[0]['start']} to {args.steps}: exit codes {codes}; losses "
          f"and state equal to an uninterrupted run's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
