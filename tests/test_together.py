"""A multi-process step's first launch waits for every process to have compiled it
(:mod:`podscale.parallel.together`)."""

import json
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from helpers import run_single

from podscale.train.tasks import make_task, make_train_step

LATE_S = 35
"""More than the 30 s that XLA's gloo set-up waits for the other processes of a new device group."""

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address, pid, late = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    jax.distributed.initialize(address, 2, pid)
    import numpy as np, optax
    from podscale import data_parallel, make_mesh
    from podscale.train.tasks import make_task, make_train_step
    task = make_task("mlp", "synthetic", seed=0)
    tx = optax.sgd(0.1)
    state = task.init_state(jax.random.key(0), tx)
    batch = task.train_data.get(np.arange(32))
    dp = data_parallel(make_train_step(task, tx), make_mesh((8,)))
    state = dp.place_state(state, batch)
    placed = dp.place_batch(jax.tree.map(lambda x: x[dp.local_rows(32)], batch), 32)
    if pid == 1:
        time.sleep(late)  # as a process still compiling while the other has finished
    state, metrics = dp(state, placed)
    print(json.dumps({"loss": float(metrics["loss"])}), flush=True)
    """
)


@pytest.mark.slow
def test_a_process_that_reaches_the_first_step_late_still_runs_it(tmp_path):
    """Process 1 reaches the first step 35 s after process 0 (as when its compile is slower under
    load: CI's two-process run ended with process 0's "Gloo context initialization failed:
    DEADLINE_EXCEEDED" while process 1 compiled). Both run the step, and give one device's loss."""
    script = tmp_path / "late.py"
    script.write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), address, str(pid), str(LATE_S)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=LATE_S + 120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    losses = [json.loads(out.strip().splitlines()[-1])["loss"] for out, _ in outputs]
    task = make_task("mlp", "synthetic", seed=0)
    tx = optax.sgd(0.1)
    _, metrics = run_single(
        make_train_step(task, tx), task.init_state(jax.random.key(0), tx), [task.train_data.get(np.arange(32))]
    )
    assert losses[0] == losses[1] and abs(losses[0] - float(metrics["loss"])) <= 1e-6, (losses, metrics["loss"])
