"""Reading collectives, their mesh axes, bytes and loop trip counts from a compiled module."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from podscale import make_mesh
from podscale.compiled import hlo, hlo_cost

TEXT = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %g = f32[64]{0} get-tuple-element(%p), index=1
  %ar = f32[64]{0} all-reduce(%g), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%outer_body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %w = (s32[], f32[64]{0}) while(%p), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = (s32[], f32[64]{0}) copy(%w)
}

ENTRY %main (x: f32[64], y: bf16[16,8]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  %y = bf16[16,8]{1,0} parameter(1)
  %rs = f32[8]{0} reduce-scatter(%x), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %ag = bf16[16,64]{1,0} all-gather(%y), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={1}
  %pair = (f32[64]{0}, bf16[16,8]{1,0}) all-reduce(%x, %y), channel_id=4, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %cp = f32[64]{0} collective-permute(%x), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %loop = (s32[], f32[64]{0}) while(%t0), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"5"}}
  %free = (s32[], f32[64]{0}) while(%t0), condition=%cond, body=%inner_body
  ROOT %o = f32[64]{0} copy(%x)
}
"""


def test_kinds_bytes_axes_and_trip_counts_from_module_text():
    module = hlo.read_text(TEXT, {"x": 4, "y": 2})
    by_name = {c.name: c for c in module.collectives}
    rs, ag, pair, cp, ar = by_name["rs"], by_name["ag"], by_name["pair"], by_name["cp"], by_name["ar"]
    assert (rs.kind, rs.axes, rs.group_size, rs.buffer_bytes, rs.count) == ("reduce-scatter", ("x", "y"), 8, 256, 1)
    assert rs.moved_bytes == 7 / 8 * 256
    assert (ag.buffer_bytes, ag.dtype, ag.moved_bytes) == (16 * 8 * 2, "bf16", 7 * 256)  # the input shard
    assert (pair.axes, pair.buffer_bytes, pair.moved_bytes) == (("y",), 256 + 256, 2 * 1 / 2 * 512)
    assert (cp.kind, cp.moved_bytes) == ("collective-permute", 256)
    # iota groups [2,4]<=[4,2]T(1,0): {0,2,4,6} and {1,3,5,7}, along x. The inner loop runs
    # 3 times per trip of the outer one (5 trips), and once more in a loop without a trip count.
    assert (ar.axes, ar.group_size, ar.count) == (("x",), 4, 3 * 5 + 1)
    assert module.unknown_trip_counts == ["free"]
    assert module.moved_bytes(["all-reduce"]) == pytest.approx(2 * 3 / 4 * 256 * 16 + 512)


def test_a_compiled_loop_of_sums_is_counted_with_its_trips():
    mesh = make_mesh((4, 2))

    def f(x):
        def body(c, _):
            return c + jax.lax.psum(c, "x"), None

        return jax.lax.scan(body, x, None, length=5)[0]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    module = hlo.read(fn.lower(jnp.ones(256)).compile(), mesh)
    (row,) = [r for r in module.totals() if r["kind"] == "all-reduce"]
    assert (row["axes"], row["dtype"], row["runs"], row["buffer_bytes"]) == (["x"], "f32", 5, 5 * 1024)
    assert module.memory["peak"] > 0


def test_the_copies_of_each_phase_are_counted_apart_from_the_work():
    """The plan lists the bytes of the module's copies per phase (XLA's relayouts, and its copies
    around aliased outputs), beside all the bytes the phase's ops move: on XLA:TPU they were most
    of the sharded update's (docs/benchmarks.md, issue 45). It says which change a layout."""
    text = """HloModule m, num_partitions=2

ENTRY %main (w: f32[64,256], u: f32[64,256]) -> f32[64,256] {
  %w = f32[64,256]{1,0} parameter(0)
  %u = f32[64,256]{1,0} parameter(1)
  %relayout = f32[64,256]{0,1} copy(%w), metadata={op_name="jit(step)/podscale_update/add"}
  %sum = f32[64,256]{0,1} add(%relayout, %u), metadata={op_name="jit(step)/podscale_update/add"}
  %fwd = f32[64,256]{1,0} copy(%u), metadata={op_name="jit(step)/dense/dot_general"}
  ROOT %out = f32[64,256]{1,0} copy(%sum), metadata={op_name="jit(step)/podscale_update/add"}
}
"""
    module = hlo.read_text(text, {"data": 2})
    tensor = 64 * 256 * 4
    assert module.copy_bytes(["update"]) == 2 * 2 * tensor  # two copies, each read and written
    assert module.copy_bytes(["forward"]) == 2 * tensor
    assert module.op_bytes(["update"]) == module.copy_bytes(["update"]) + 3 * tensor
    assert module.to_dict()["copy_bytes"] == {"forward": 2 * tensor, "backward": 0, "update": 4 * tensor}
    # Of them, the update's two change a layout ({1,0} <-> {0,1}); the forward's keeps its own.
    assert module.to_dict()["relayout_bytes"] == {"forward": 0, "backward": 0, "update": 4 * tensor}
    assert module.copy_bytes(["forward"], relayouts=False) == 2 * tensor
    assert module.copy_bytes(relayouts=False) == 2 * tensor


def test_a_copy_is_a_relayout_where_its_order_or_tiles_change_not_its_memory_space():
    assert hlo_cost.relayout("copy", "f32[8,128]{0,1:T(8,128)}", ["f32[8,128]{1,0:T(8,128)}"])
    assert hlo_cost.relayout("copy", "f32[8,128]{1,0:T(8,128)}", ["f32[8,128]{1,0:T(2,128)}"])
    assert not hlo_cost.relayout("copy", "f32[8,128]{1,0:T(8,128)S(1)}", ["f32[8,128]{1,0:T(8,128)}"])
    assert not hlo_cost.relayout("copy", "f32[8,128]{1,0}", [""])  # an operand of unknown type
    assert not hlo_cost.relayout("add", "f32[8,128]{0,1}", ["f32[8,128]{1,0}"])


MULTISLICE = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[4,8,128]) -> f32[4,8,128] {
  %x = f32[4,8,128]{2,1,0} parameter(0)
  %ar = f32[4,8,128]{2,1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add, metadata={op_name="jit(body)/podscale_update/grad_sum/psum_invariant"}
  %bc = f32[4,8,128]{2,1,0} bitcast(%ar)
  %tok = token[] after-all(), frontend_attributes={MegascaleRendezvousKeyName="psum_invariant.14_0"}
  %send = (f32[4,8,128]{2,1,0}, u32[], token[]) send(%bc, %tok), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="psum_invariant.14_0"}
  %recv = (f32[4,8,128]{2,1,0}, u32[], token[]) recv(%tok), channel_id=1, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="psum_invariant.14_0"}
  %sd = token[] send-done(%send), channel_id=2, is_host_transfer=true
  %rd = (f32[4,8,128]{2,1,0}, token[]) recv-done(%recv), channel_id=1, is_host_transfer=true
  ROOT %out = f32[4,8,128]{2,1,0} get-tuple-element(%rd), index=0
}
"""


def test_a_multislice_module_s_sends_to_the_megascale_runtime_are_collectives_across_slices():
    """XLA:TPU's module for two slices sums a buffer within each slice (its own all-reduce) and
    sends it to the megascale runtime for the sum across the slices: that send is read as an
    all-reduce over the slices (axes ``(DCN,)``), of the buffer sent, in the phase of what it sends."""
    module = hlo.read_text(MULTISLICE, {"data": 8}, platform="tpu", slices=2)
    within, across = module.collectives
    assert within.kind == "all-reduce" and within.group_size == 4
    assert across.kind == "all-reduce" and across.axes == (hlo.DCN,) and across.group_size == 2
    assert across.buffer_bytes == 4 * 8 * 128 * 4 and hlo.UPDATE_SCOPE in across.op_name


ASYNC_FUSION = """HloModule m, num_partitions=4

%region (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%start_comp (p: f32[1024]) -> (f32[1024], f32[1024], u32[]) {
  %p = f32[1024]{0} parameter(0)
  %ar = f32[1024]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%region, metadata={op_name="podscale_update/grad_sum/psum"}
  ROOT %cs = (f32[1024]{0}, f32[1024]{0}, u32[]) custom-call(%ar), custom_call_target="AsyncCollectiveStart"
}

%done_comp (q0: f32[1024], q1: f32[1024], q2: u32[]) -> f32[1024] {
  %q0 = f32[1024]{0} parameter(0)
  %q1 = f32[1024]{0} parameter(1)
  %q2 = u32[] parameter(2)
  %ar2 = f32[1024]{0} all-reduce(%q0), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%region
  ROOT %cd = f32[1024]{0} custom-call(%q0, %q1, %ar2, %q2), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (x: f32[1024], y: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %y = f32[1024]{0} parameter(1)
  %s = (f32[1024]{0}, f32[1024]{0}, u32[]) fusion(%x), kind=kCustom, calls=%start_comp
  %m = f32[1024]{0} multiply(%y, %y), metadata={op_name="transpose(jvp())/mul"}
  %g0 = f32[1024]{0} get-tuple-element(%s), index=0
  %g1 = f32[1024]{0} get-tuple-element(%s), index=1
  %g2 = u32[] get-tuple-element(%s), index=2
  %d = f32[1024]{0} fusion(%g0, %g1, %g2), kind=kCustom, calls=%done_comp
  ROOT %r = f32[1024]{0} add(%d, %m), metadata={op_name="podscale_update/add"}
}
"""


def test_xla_tpu_s_asynchronous_collective_fusion_is_one_collective_started_and_waited_for():
    """XLA:TPU's async collective fusion (``LIBTPU_INIT_ARGS``'s
    ``xla_tpu_enable_async_collective_fusion``): a ``kCustom`` fusion returning an
    ``AsyncCollectiveStart`` custom call over the all-reduce, and one returning an
    ``AsyncCollectiveDone`` (each holding a copy of the collective). One all-reduce, started at the
    first and waited for at the second, the multiply between them hiding it; a done that is not
    found is waited for at the computation's end, never hidden past it."""
    module = hlo.read_text(ASYNC_FUSION, {"data": 4}, platform="tpu")
    (c,) = module.collectives
    assert (c.kind, c.buffer_bytes, c.group_size) == ("all-reduce", 4096, 4)
    kinds = [e[0] if e[0] != "op" else module.ops[e[1]].opcode for e in module.schedule[module.entry]]
    assert kinds[0] == "start" and kinds.index("multiply") < kinds.index("done") < kinds.index("add"), kinds
    lost = hlo.read_text(ASYNC_FUSION.replace("fusion(%g0, %g1, %g2)", "fusion(%y, %y, %g2)"), {"data": 4}, "tpu")
    # %g2 still reads the start: found through it
    assert [e[0] for e in lost.schedule[lost.entry]].count("done") == 1
    unread = ASYNC_FUSION.replace("fusion(%g0, %g1, %g2)", "fusion(%y, %y, %y)")
    none = hlo.read_text(
        unread.replace("(q0: f32[1024], q1: f32[1024], q2: u32[])", "(q0: f32[1024], q1: f32[1024], q2: f32[1024])"),
        {"data": 4},
        "tpu",
    )
    events = [e[0] for e in none.schedule[none.entry]]
    assert events[-1] == "done" and events.count("done") == 1, events
