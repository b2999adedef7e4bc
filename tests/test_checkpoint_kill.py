"""``kill -9`` during an asynchronous save: the last complete checkpoint restores bit for bit, ten
times in a row. A child process saves a sharded state every step (orbax writes in the background
while the next step runs) and is killed right after a save began; this process then restores the
newest step orbax committed and compares it with the state that step had, computed here."""

import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from podscale import make_mesh
from podscale.train.checkpoint import Checkpointer

ROWS, COLS = 512, 256  # 512 KiB a leaf: a save is still being written when the next step runs

CHILD = r"""
import sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
from podscale import make_mesh
from podscale.train.checkpoint import Checkpointer

directory, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mesh = make_mesh()
spread = jax.NamedSharding(mesh, jax.P("data"))
state = {"w": jnp.zeros((rows, cols), jnp.float32), "m": jnp.ones((rows, cols), jnp.float32)}
state = jax.device_put(state, spread)
advance = jax.jit(lambda s, t: {"w": s["w"] * 0.5 + t, "m": s["m"] * 1.25 - t}, out_shardings=spread)
ckpt = Checkpointer(directory, every=1)
for step in range(1, 1000):
    state = advance(state, jnp.float32(step))
    ckpt.maybe_save(step, state)
    print(f"saving {step}", flush=True)
"""


def _expected(step: int) -> dict[str, np.ndarray]:
    w, m = np.zeros((ROWS, COLS), np.float32), np.ones((ROWS, COLS), np.float32)
    for t in range(1, step + 1):
        w, m = w * np.float32(0.5) + np.float32(t), m * np.float32(1.25) - np.float32(t)
    return {"m": m, "w": w}


@pytest.mark.slow
def test_kill_9_during_an_async_save_leaves_the_last_complete_checkpoint_bit_identical(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    like = {
        k: jax.ShapeDtypeStruct((ROWS, COLS), np.float32, sharding=jax.NamedSharding(make_mesh(), jax.P("data")))
        for k in ("m", "w")
    }
    rng = np.random.default_rng(0)
    in_flight = 0  # kills that landed while orbax was writing a step (measured: 10 of 10)
    for attempt in range(10):
        directory = tmp_path / str(attempt)
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(directory), str(ROWS), str(COLS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        kill_after = int(rng.integers(2, 6))  # right after this save began: its write is in flight
        try:
            for line in child.stdout:
                if line.strip() == f"saving {kill_after}":
                    break
            else:
                pytest.fail(f"attempt {attempt}: the child ended before saving step {kill_after}")
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
        ckpt = Checkpointer(str(directory), every=1)
        step, restored = ckpt.restore(like)
        ckpt.close()
        assert 1 <= step <= kill_after, (attempt, step, kill_after)
        in_flight += os.path.isdir(directory / f"{kill_after}.orbax-checkpoint-tmp")
        want = _expected(step)
        for k in ("m", "w"):
            assert np.asarray(restored[k]).tobytes() == want[k].tobytes(), f"attempt {attempt}: step {step}, {k}"
    assert in_flight, "no kill landed during a save: the test did not test it"
