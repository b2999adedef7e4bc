"""``podscale project`` on XLA:GPU's module (JAX's CUDA plugin's compile-only devices), on tiny steps.

The tests that compile need the plugin (``pip install 'podscale[gpu-compile]'``), which CI does not
install: they are skipped without it. The rest (the choice of compiler, the fallback, the
refusals, the target configs' figures) run everywhere."""

import sys

import jax
import jax.numpy as jnp
import optax
import pytest

from podscale import cli
from podscale.compiled import gpu, systems, tpu
from podscale.projection import project

needs_plugin = pytest.mark.skipif(
    not gpu.available(), reason="JAX's CUDA plugin not installed (pip install 'podscale[gpu-compile]')"
)

TX = optax.adam(1e-3)


def _state(width: int = 128):
    def init():
        params = {"w1": jnp.zeros((64, width)), "w2": jnp.zeros((width, 8))}
        return {"params": params, "opt": TX.init(params)}

    return jax.eval_shape(init)


def _step(state, batch):
    def loss(params):
        hidden = jnp.tanh(batch["x"] @ params["w1"])
        return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

    grads = jax.grad(loss)(state["params"])
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}


def _batch(n: int):
    return {"x": jax.ShapeDtypeStruct((n, 64), jnp.float32), "y": jax.ShapeDtypeStruct((n, 8), jnp.float32)}


def test_auto_picks_xla_gpu_for_a_gpu_system_only_where_the_plugin_is_installed(monkeypatch):
    monkeypatch.setattr(gpu, "available", lambda: True)
    assert project.compiler_for(systems.get("h100"), "auto") == "gpu"
    assert project.compiler_for(systems.get("a100"), "gpu") == "gpu"
    assert project.compiler_for(systems.get("h100"), "cpu") == "cpu"
    assert not project.use_tpu_compiler(systems.get("h100"), "auto")
    monkeypatch.setattr(gpu, "available", lambda: False)
    lines = []
    assert project.compiler_for(systems.get("h200"), "auto", lines.append) == "cpu"
    assert lines == [gpu.MISSING]


def test_without_the_plugin_a_gpu_system_falls_back_to_the_cpu_module_and_says_so(monkeypatch):
    monkeypatch.setattr(gpu, "available", lambda: False)
    lines = []
    (row,) = project.project(
        _step, _state(), _batch(2), system="h100", chips=[8], strategies=["replicated"], progress=lines.append
    )
    assert row.compiler == "XLA:CPU" and row.step_s > 0
    assert sum("JAX's CUDA plugin is not installed: costing XLA:CPU's module" in line for line in lines) == 1
    assert sum("pip install 'podscale[gpu-compile]'" in line for line in lines) == 1


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_compiler_gpu_without_the_plugin_is_one_refusal_naming_the_extra(monkeypatch, capsys, dry_run):
    monkeypatch.setattr(gpu, "available", lambda: False)
    argv = ["project", "--model", "mlp", "--system", "h100", "--chips", "8", "--compiler", "gpu", *dry_run]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("podscale: error: --compiler gpu: XLA:GPU needs JAX's CUDA plugin"), line
    assert "pip install 'podscale[gpu-compile]'" in line and "costing" not in line
    assert captured.out == ""


def test_compiler_gpu_on_a_tpu_system_and_tpu_on_a_gpu_system_are_refused(capsys):
    for system, compiler, other in (("tpu-v3", "gpu", "tpu"), ("h100", "tpu", "gpu")):
        argv = ["project", "--model", "mlp", "--system", system, "--chips", "8", "--compiler", compiler, "--dry-run"]
        assert cli.main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"--compiler {compiler}: {system!r} is not a {compiler.upper()} system (--compiler {other}," in line
    with pytest.raises(ValueError, match="'tpu-v4' is not a GPU system"):
        project.compiler_for(systems.get("tpu-v4"), "gpu")


def test_the_dry_run_names_the_compiler(monkeypatch, capsys):
    argv = ["project", "--model", "mlp", "--system", "h100", "--chips", "8", "--dry-run"]
    monkeypatch.setattr(gpu, "available", lambda: True)  # nothing is compiled: the plugin is not loaded
    assert cli.main(argv) == 0
    assert "compiler XLA:GPU (CUDA plugin, compile-only), cpu_devices 0" in capsys.readouterr().out
    monkeypatch.setattr(gpu, "available", lambda: False)
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "compiler XLA:CPU, cpu_devices 8" in captured.out and gpu.MISSING in captured.err


def test_the_target_configs_agree_with_the_systems_figures():
    """The config XLA:GPU compiles for and the figures the module is costed with describe the
    same GPU: SMs x FP32 lanes x clock, memory and bandwidth within a few percent (the datasheet
    rounds; the driver reports its usable memory)."""
    for name, spec in gpu.SPECS.items():
        system = systems.get(name)
        assert system.kind == "gpu"
        assert spec.sms * spec.fp32_per_sm * spec.clock_ghz * 1e9 == pytest.approx(system.vector_rate)
        assert spec.bandwidth == pytest.approx(system.hbm_bandwidth, rel=0.03)
        assert spec.memory_bytes == pytest.approx(system.hbm_bytes, rel=0.1)
        text = gpu.target_config(name)
        assert f"core_count: {spec.sms}\n" in text and f'device_description_str: "{spec.name}"' in text
    assert set(gpu.SPECS) == {s.name for s in systems.SYSTEMS.values() if s.kind == "gpu"}
    assert [gpu.topology_name(systems.get("h100"), n) for n in (1, 4, 8, 64)] == [
        "h100:1x1",
        "h100:1x4",
        "h100:1x8",
        "h100:8x8",
    ]
    with pytest.raises(ValueError, match="no GPU target config"):
        gpu.target_config("tpu-v3")


@pytest.mark.parametrize(
    "libtpu, tpu_here, cuda, gpu_here, other, quiet",
    [
        (False, False, True, False, False, True),  # the CUDA plugin on a host without a GPU: the CPU
        (False, False, True, True, False, False),  # ... with a GPU: JAX's choice
        (True, False, False, False, False, True),  # libtpu without a TPU (as before)
        (True, False, True, True, False, False),  # libtpu without a TPU, a GPU with its plugin
        (True, True, True, False, False, False),  # a TPU host with the CUDA plugin: left alone
        (False, False, True, False, True, False),  # another plugin: JAX's choice
        (False, False, False, False, False, False),  # no plugin at all
    ],
)
def test_quiet_platforms_keeps_jax_on_the_cpu_where_a_plugin_lacks_its_accelerator(
    monkeypatch, libtpu, tpu_here, cuda, gpu_here, other, quiet
):
    import importlib.metadata

    names = ["xla_cuda12"] * cuda + ["xla_rocm7"] * other
    points = [importlib.metadata.EntryPoint(n, f"jax_plugins.{n}", "jax_plugins") for n in names]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: points)
    monkeypatch.setattr(tpu, "available", lambda: libtpu)
    monkeypatch.setattr(tpu, "has_tpu", lambda: tpu_here)
    monkeypatch.setattr(tpu, "_has_nvidia_gpu", lambda: gpu_here)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # restored after the test, as is what follows
    monkeypatch.delenv(tpu.ENV_SET_PLATFORMS, raising=False)
    monkeypatch.delitem(sys.modules, "jax")  # as before JAX is imported: the variable is what changes
    tpu.quiet_platforms()
    import os

    assert os.environ.get("JAX_PLATFORMS") == ("cpu" if quiet else None)


@needs_plugin
def test_importing_podscale_keeps_jax_quiet_with_the_plugin_and_no_gpu():
    """The plugin's CUDA check would fail at JAX's start on this host (and then register nothing):
    importing podscale first keeps JAX on the CPU, and the GPU's compile-only devices still come."""
    import subprocess

    if tpu._has_nvidia_gpu():
        pytest.skip("this host has an NVIDIA GPU: JAX starts its CUDA backend")
    code = (
        "import podscale, jax\n"
        "from podscale.compiled import gpu\n"
        "print(jax.devices()[0].platform, gpu.devices('h100', 'h100:1x8')[7].device_kind)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("JAX_PLATFORMS", tpu.ENV_SET_PLATFORMS)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cpu NVIDIA H100 80GB HBM3"
    assert "Traceback" not in proc.stderr and "Unable to load CUDA" not in proc.stderr, proc.stderr


@needs_plugin
def test_each_system_s_config_reaches_xla_and_triton_gemm_is_off_for_these_compiles_only():
    """The device XLA:GPU compiles for is the config's (its name); the projection's compile options
    send matrix products to cuBLAS, where the default (Triton gemm, untuned) emits Triton fusions."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    for name, spec in gpu.SPECS.items():
        assert gpu.devices(name, f"{name}:1x2")[1].device_kind == spec.name
    mesh = Mesh(list(gpu.devices("h100", "h100:1x1")), ("x",))
    at = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=at) for s in ((512, 1024), (1024, 2048))]
    lowered = jax.jit(jax.grad(lambda x, w: jnp.tanh(x @ w).sum(), argnums=1)).lower(*args)
    plain = lowered.compile().as_text()
    ours = lowered.compile(gpu.COMPILER_OPTIONS).as_text()
    triton = '"kind":"__triton_nested_gemm_fusion"'  # a Triton gemm fusion's backend config
    assert "__cublas$lt$matmul" in ours and triton not in ours
    assert triton in plain  # the default left as it was: the option is per compile


@needs_plugin
def test_a_small_step_projects_on_xla_gpu_with_its_collectives_and_schedule():
    lines = []
    rows = project.project(
        _step,
        _state(),
        _batch(4),
        system="h100",
        chips=[8, 16],
        strategies=["replicated", "sharded"],
        progress=lines.append,
    )
    assert [(r.chips, r.strategy, r.compiler) for r in rows] == [
        (8, "replicated", "XLA:GPU h100:1x8"),
        (8, "sharded", "XLA:GPU h100:1x8"),
        (16, "replicated", "XLA:GPU h100:2x8"),
        (16, "sharded", "XLA:GPU h100:2x8"),
    ]
    for row in rows:
        assert row.fits and row.step_s > 0 and row.compile_s is not None
        kinds = {c["kind"] for c in row.collectives}
        assert "all-reduce" in kinds or "reduce-scatter" in kinds, (row.strategy, kinds)
    assert any("compiling with XLA:GPU" in line for line in lines)
    assert not any("not installed" in line for line in lines)


@needs_plugin
@pytest.mark.slow
def test_the_cli_projects_mlp_on_each_gpu_system(capsys):
    for system in gpu.SPECS:
        argv = ["project", "--model", "mlp", "--system", system, "--chips", "8", "--strategies", "replicated"]
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert f"XLA:GPU {system}:1x8" in out, out
