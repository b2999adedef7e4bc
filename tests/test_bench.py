import pytest

from podscale.bench.wus import bench_wus, hlo_collectives


def test_hlo_collectives_reads_kinds_and_bytes():
    hlo = """
  %all-reduce.1 = f32[1024]{0} all-reduce(f32[1024]{0} %p), replica_groups={}
  %rs = f32[128]{0} reduce-scatter(f32[1024]{0} %q), dimensions={0}
  %ag = (f32[8,16]{1,0}, /*index=1*/bf16[4]{0}) all-gather(f32[1,16]{1,0} %a, bf16[1]{0} %b), dimensions={0}
  %ags = (f32[2]{0}, f32[16]{0}) all-gather-start(f32[2]{0} %c), dimensions={0}
"""
    assert hlo_collectives(hlo) == {
        "all-reduce": 4096,
        "reduce-scatter": 512,
        "all-gather": 8 * 16 * 4 + 4 * 2 + 16 * 4,
    }


@pytest.mark.slow
def test_bench_wus_reports_every_variant_on_a_tiny_model():
    result = bench_wus(optimizers=("adam",), steps=1, width=32, depth=1, vocab=64, seq=16)
    per = result["adam"]
    assert set(per) == {"replicated", "sharded", "gspmd"}
    for r in per.values():
        assert {"step_s", "update_s", "peak_bytes_per_device", "collectives", "max_abs_param_diff"} <= set(r)
    assert "reduce-scatter" in per["sharded"]["collectives"]
    assert per["sharded"]["max_abs_param_diff"] <= 1e-6 and per["gspmd"]["max_abs_param_diff"] <= 1e-5
