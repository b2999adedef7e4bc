import re

import pytest

from podscale.bench import BENCHMARKS
from podscale.bench.wus import bench_wus


@pytest.mark.slow
def test_bench_wus_reports_every_variant_on_a_tiny_model():
    result = bench_wus(optimizers=("adam",), steps=1, width=32, depth=1, vocab=64, seq=16)
    per = result["adam"]
    assert set(per) == {"replicated", "sharded", "fsdp", "gspmd"}
    for r in per.values():
        assert {"step_s", "update_s", "peak_bytes_per_device", "collectives", "max_abs_param_diff"} <= set(r)
        assert r["bytes_vs_limit"] > 0.9
    assert "reduce-scatter" in per["sharded"]["collectives"]
    assert per["sharded"]["max_abs_param_diff"] <= 1e-6 and per["gspmd"]["max_abs_param_diff"] <= 1e-5
    assert per["sharded"]["bytes_vs_limit"] <= 1.05
    assert per["fsdp"]["max_abs_param_diff"] <= 1e-6 and "reduce-scatter" in per["fsdp"]["collectives"]
    assert per["fsdp"]["peak_bytes_per_device"] < per["replicated"]["peak_bytes_per_device"]


@pytest.mark.slow
def test_bench_wus_runs_on_an_mlperf_workload_with_its_recipe():
    result = bench_wus(steps=1, model="transformer-big", variants=("replicated", "sharded"))
    assert result["config"]["model"] == "transformer-big" and set(result) == {"recipe", "config"}
    sharded = result["recipe"]["sharded"]
    assert sharded["bytes_vs_limit"] <= 1.05 and "reduce-scatter" in sharded["collectives"]
    assert (
        result["recipe"]["sharded"]["peak_bytes_per_device"] <= result["recipe"]["replicated"]["peak_bytes_per_device"]
    )


def test_bench_spatial_shows_memory_falling_and_halos_appearing_with_k():
    from podscale.bench.spatial import bench_spatial

    result = bench_spatial(ks=(1, 2, 4), batch=2, image=32, features=8, steps=1)
    rows = [result[str(k)] for k in (1, 2, 4)]
    temps = [r["temporaries_bytes_per_device"] for r in rows]
    assert temps[1] < temps[0] and temps[2] < temps[1], temps
    assert rows[0]["halo_bytes_per_device"] == 0 and all(r["halo_bytes_per_device"] > 0 for r in rows[1:])
    assert all(r["uneven_layers"] == 0 and r["step_s"] > 0 for r in rows)
    # Every k computes the same step: the losses agree to float32 summation order.
    assert max(r["final_loss"] for r in rows) - min(r["final_loss"] for r in rows) <= 1e-5


def test_bench_tp_splits_weights_and_work_and_computes_the_same_step():
    from podscale.bench.tp import bench_tp

    result = bench_tp(ks=(1, 2, 4), batch=8, seq=16, width=128, heads=4, vocab=256, steps=1)
    rows = [result[str(k)] for k in (1, 2, 4)]
    for k, r in zip((1, 2, 4), rows, strict=True):
        assert r["weight_bytes_per_device"] * k <= rows[0]["weight_bytes_per_device"] * 1.1  # unsplit: norms, positions
        assert abs(r["flops_vs_replica_on_one_device"] - 1 / k) <= 0.1 / k, r
        assert r["rule_notes"] == 0 and r["step_s"] > 0
    assert "y" not in rows[0]["collective_bytes_per_axis"] and all(
        r["collective_bytes_per_axis"]["y"] > 0 for r in rows[1:]
    )
    assert max(r["final_loss"] for r in rows) - min(r["final_loss"] for r in rows) <= 1e-5


def test_bench_embedding_splits_tables_by_rows_and_sends_no_table_sized_all_reduce():
    from podscale.bench.embedding import bench_embedding

    result = bench_embedding(rows=1024, dim=8, tables=2, batch=64, steps=1)
    split, replicated = result["split"], result["replicated"]
    assert split["tables_split"] == 2 and replicated["tables_split"] == 0
    assert split["table_bytes_per_device"] * 8 == replicated["table_bytes_per_device"] == 2 * 1024 * 8 * 4
    table_gradients = 2 * 1024 * 8 * 4 * 2 * 7 / 8  # a ring all-reduce of both tables' gradients
    assert replicated["sent_bytes_per_device"]["all-reduce"] >= table_gradients
    assert split["sent_bytes_per_device"].get("all-reduce", 0) < 1024  # the dense layer's gradient only
    assert split["sent_bytes_per_device"]["reduce-scatter"] > 0  # the looked-up rows, to their examples
    assert abs(split["final_loss"] - replicated["final_loss"]) <= 1e-6
    lookups = result["lookups"]  # two exact lookups: the rows bit for bit, the same bytes moved
    assert all(r["rows_max_difference"] == 0 and r["gradient_max_difference"] <= 1e-6 for r in lookups.values())
    masked, a2a = lookups["masked gather"]["sent_bytes_per_device"], lookups["all-to-all"]["sent_bytes_per_device"]
    assert set(masked) == {"all-gather", "reduce-scatter"} and set(a2a) == {"all-to-all"}
    assert a2a["all-to-all"] >= masked["reduce-scatter"]  # room for every id at one device: the rows' buffer


# -- Every bench flag is checked up front, for each benchmark (issue 23, findings 9 and 10) -------

BAD_FLAGS = [
    # (benchmark, flag and value, what the message says)
    *[("gradsum", ["--sizes", v], "--sizes") for v in ["-1", "0", "nan", "inf", "abc", "1,,2", "1e-9", "", "1;2"]],
    *[(w, ["--steps", v], "--steps must be a whole number of at least 1") for w in BENCHMARKS for v in ["0", "-1"]],
    *[
        (w, [f, v], f"{f} must be a whole number of at least 1")
        for w in ("wus", "tp")
        for f in ("--width", "--depth", "--vocab")
        for v in ["0", "-5"]
    ],
    ("wus", ["--width", "100"], "--width 100 must be a multiple of the decoder's 8 attention heads"),
    ("wus", ["--model", "gpt9"], "--model 'gpt9': bench wus takes an MLPerf workload"),
    (
        "wus",
        ["--model", "gnmt", "--width", "64"],
        "--width sets the size of bench wus's own decoder; with --model gnmt",
    ),
    ("tp", ["--width", "100"], "bench tp: --width 100 must be a multiple of the 8 heads"),
    ("tp", ["--vocab", "5"], "bench tp: --width 256 and --vocab 5 must split 4 ways"),
    *[
        (w, ["--model", "gnmt"], "--model is for bench wus and checkpoint; bench " + w)
        for w in ("gradsum", "spatial", "tp")
    ],
    ("checkpoint", ["--model", "gpt9"], "--model 'gpt9': bench checkpoint takes an MLPerf workload"),
    ("checkpoint", ["--config", "huge"], "--config 'huge': choose full or tiny"),
    *[(w, ["--config", "tiny"], "--config is for bench checkpoint; bench " + w) for w in ("wus", "gradsum", "tp")],
    *[(w, ["--sizes", "1"], "--sizes is for bench gradsum; bench " + w) for w in ("wus", "spatial", "tp")],
    *[
        (w, [f, "64"], f"{f} is for bench wus and tp; bench {w}")
        for w in ("gradsum", "spatial")
        for f in ("--width", "--depth", "--vocab")
    ],
]


@pytest.mark.parametrize(("which", "args", "message"), BAD_FLAGS, ids=[f"{w} {' '.join(a)}" for w, a, _ in BAD_FLAGS])
def test_a_bad_bench_flag_is_refused_before_any_work_naming_the_flag(monkeypatch, capsys, which, args, message):
    from podscale import cli
    from podscale.train import distributed

    def no_work(*_):
        raise AssertionError("bench went on to set up devices with a bad flag")

    monkeypatch.setattr(distributed, "setup", no_work)
    assert cli.main(["bench", which, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_every_flag_a_benchmark_does_not_take_is_refused():
    from podscale.bench import FLAGS, check_flags

    for which in BENCHMARKS:
        for flag, takers in FLAGS.items():
            if which not in takers:
                with pytest.raises(ValueError, match=f"--{flag} is for bench"):
                    check_flags(which, {"steps": 4, flag: "1" if flag in ("sizes", "model") else 8})


BAD_ARGUMENTS = [
    ("wus", {"steps": 0}, ValueError, "steps must be at least 1"),
    ("wus", {"steps": 2.5}, TypeError, "steps=2.5 is a float"),
    ("wus", {"vocab": -5}, ValueError, "vocab must be at least 1"),
    ("wus", {"width": 100}, ValueError, "width=100 must be a multiple"),
    ("wus", {"model": "gpt9"}, ValueError, "model='gpt9'"),
    ("wus", {"variants": ("zero3",)}, ValueError, "variants="),
    ("wus", {"optimizers": ("nosuch",)}, ValueError, "optimizers="),
    ("gradsum", {"sizes_mib": (-1,)}, ValueError, "sizes_mib must be a finite number above 0"),
    ("gradsum", {"sizes_mib": (0,)}, ValueError, "sizes_mib must be a finite number above 0"),
    ("gradsum", {"sizes_mib": (1e-9,)}, ValueError, "less than one float32 per device"),
    ("gradsum", {"sizes_mib": "1,2"}, TypeError, "sizes_mib='1,2'"),
    ("gradsum", {"repeats": 0}, ValueError, "repeats must be at least 1"),
    ("spatial", {"steps": -1}, ValueError, "steps must be at least 1"),
    ("spatial", {"ks": (0,)}, ValueError, "ks must be at least 1"),
    ("spatial", {"image": 0}, ValueError, "image must be at least 1"),
    ("tp", {"depth": 0}, ValueError, "depth must be at least 1"),
    ("tp", {"vocab": 5}, ValueError, "vocab=5 must split 4 ways"),
    ("tp", {"weight_update": "zero3"}, ValueError, "weight_update='zero3'"),
]


@pytest.mark.parametrize(
    ("which", "kwargs", "error", "message"), BAD_ARGUMENTS, ids=[f"{w} {k}" for w, k, _, _ in BAD_ARGUMENTS]
)
def test_a_bench_function_checks_its_arguments_first(monkeypatch, which, kwargs, error, message):
    import importlib

    module = importlib.import_module(f"podscale.bench.{which}")

    def no_work(*_, **__):
        raise AssertionError("the benchmark began work with a bad argument")

    for name in ("make_mesh", "Mesh", "data_parallel", "make_grad_sum"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, no_work)
    with pytest.raises(error, match=re.escape(message)):
        getattr(module, f"bench_{which}")(**kwargs)


def test_bench_wus_prints_progress_lines_when_stderr_is_not_a_terminal(capsys):
    from podscale.bench.wus import _Progress

    with _Progress(True, 4) as bar:
        bar.update("adam: compiling replicated", line=True)
        bar.update("adam: step 1/2")  # within a few seconds of the last line: not printed
        bar.advance()
        bar.ticker.last -= _Progress.EVERY_S
        bar.update("adam: step 2/2")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "podscale bench wus: adam: compiling replicated",
        "podscale bench wus: adam: step 2/2",
    ]
    with _Progress(False, 4) as bar:
        bar.update("quiet", line=True)
    assert capsys.readouterr().err == ""


def test_bench_checkpoint_saves_a_sharded_state_async_and_sync_and_restores_it_bit_for_bit():
    """Figures of their own kinds (no timing is compared: this machine is shared): the stall of
    each kind of save, the memory a save adds, and the restore's bits."""
    from podscale.bench.checkpoint import bench_checkpoint

    result = bench_checkpoint(model="transformer-big", config="tiny", steps=1)
    assert result["restored_fingerprints_equal"] is True
    assert result["replicas"] == 8 and result["saves"] == 1
    assert 0 < result["device_state_bytes"] < result["state_bytes"]  # the optimizer state is chunked
    assert result["largest_saved_buffer_bytes"] <= result["largest_leaf_bytes"]
    assert result["process_shard_bytes"] >= result["state_bytes"]  # one process writes a copy of all (chunks padded)
    assert result["async_stall_s"] > 0 and result["sync_stall_s"] > 0
