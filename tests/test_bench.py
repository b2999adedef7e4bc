import pytest

from podscale.bench.wus import bench_wus


@pytest.mark.slow
def test_bench_wus_reports_every_variant_on_a_tiny_model():
    result = bench_wus(optimizers=("adam",), steps=1, width=32, depth=1, vocab=64, seq=16)
    per = result["adam"]
    assert set(per) == {"replicated", "sharded", "gspmd"}
    for r in per.values():
        assert {"step_s", "update_s", "peak_bytes_per_device", "collectives", "max_abs_param_diff"} <= set(r)
        assert r["bytes_vs_limit"] > 0.9
    assert "reduce-scatter" in per["sharded"]["collectives"]
    assert per["sharded"]["max_abs_param_diff"] <= 1e-6 and per["gspmd"]["max_abs_param_diff"] <= 1e-5
    assert per["sharded"]["bytes_vs_limit"] <= 1.05


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
