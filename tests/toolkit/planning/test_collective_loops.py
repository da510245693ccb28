"""How often the collective parser (toolkit.planning.collectives) counts a collective per step, on
small HLO texts written like libtpu's: loops that do not step by one (XLA's windowed einsum
runs two ring steps per iteration), loops that start past zero, and an instruction whose text
spans lines (the splash kernel's custom call), after which the rest of its computation must
still be read: loops, collectives and, across slices, the DCN transfers in it. Then the same
on a real two-slice compile (`tpu_aot`), and the estimate's bytes across slices beside it."""
from __future__ import annotations

import pytest

import sharding
from experiments import lm
from models import LlamaConfig
from tests import extras
from toolkit.planning import aot, collectives, estimate, target as target_lib

# Two slices of 4 devices; the program is one slice's (num_partitions=4). A loop over 3 chunks
# (i = 1, 2, 3) holds a custom call whose attributes span three lines, then an all-gather, a
# windowed-einsum ring loop (i < 4 stepping by 2: 2 trips of a bidirectional ring on 4
# devices) and a cross-slice gradient all-reduce (a MegaScale send).
_HLO = """HloModule jit_train_step, is_scheduled=true, num_partitions=4

%ring_body (p.1: (f32[8,16], u32[])) -> (f32[8,16], u32[]) {
  %p.1 = (f32[8,16]{1,0}, u32[]) parameter(0)
  %x.1 = f32[8,16]{1,0} get-tuple-element(%p.1), index=0
  %i.1 = u32[]{:T(128)} get-tuple-element(%p.1), index=1
  %copy.1 = u32[]{:T(128)} copy(%i.1)
  %two.1 = u32[]{:T(128)} constant(2)
  %cp-start.1 = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%x.1), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp-done.1 = f32[8,16]{1,0} collective-permute-done(%cp-start.1)
  %cp-start.2 = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%x.1), channel_id=2, source_target_pairs={{0,3},{1,0},{2,1},{3,2}}
  %cp-done.2 = f32[8,16]{1,0} collective-permute-done(%cp-start.2)
  %next.1 = u32[]{:T(128)} add(%copy.1, %two.1)
  ROOT %t.1 = (f32[8,16]{1,0}, u32[]) tuple(%cp-done.1, %next.1)
}

%ring_cond (p.2: (f32[8,16], u32[])) -> pred[] {
  %limit.2 = u32[]{:T(128)} constant(4)
  %p.2 = (f32[8,16]{1,0}, u32[]) parameter(0)
  %i.2 = u32[]{:T(128)} get-tuple-element(%p.2), index=1
  ROOT %lt.2 = pred[]{:T(512)} compare(%i.2, %limit.2), direction=LT
}

%chunk_body (p.3: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p.3 = (s32[], f32[8,16]{1,0}) parameter(0)
  %i.3 = s32[] get-tuple-element(%p.3), index=0
  %x.3 = f32[8,16]{1,0} get-tuple-element(%p.3), index=1
  %kernel.3 = f32[8,16]{1,0} custom-call(%x.3), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512, \\"block_kv\\": 512}"
}}, metadata={op_name="jit(train_step)/splash_mha_fwd/pallas_call"}
  %all-gather.3 = f32[8,64]{1,0} all-gather(%kernel.3), channel_id=3, replica_groups=[1,4]<=[4], dimensions={1}, use_global_device_ids=true
  %zero.3 = u32[] constant(0)
  %ring_state.3 = (f32[8,16]{1,0}, u32[]) tuple(%kernel.3, %zero.3)
  %while.3 = (f32[8,16]{1,0}, u32[]) while(%ring_state.3), condition=%ring_cond, body=%ring_body
  %send.3 = (f32[2,16]{1,0}, u32[], token[]) send(%x.3, %after-all.3), channel_id=4, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %one.3 = s32[] constant(1)
  %next.3 = s32[] add(%i.3, %one.3)
  ROOT %t.3 = (s32[], f32[8,16]{1,0}) tuple(%next.3, %x.3)
}

%chunk_cond (p.4: (s32[], f32[8,16])) -> pred[] {
  %p.4 = (s32[], f32[8,16]{1,0}) parameter(0)
  %i.4 = s32[] get-tuple-element(%p.4), index=0
  %limit.4 = s32[] constant(4)
  ROOT %lt.4 = pred[] compare(%i.4, %limit.4), direction=LT
}

ENTRY %main (a.5: f32[8,16]) -> f32[8,16] {
  %a.5 = f32[8,16]{1,0} parameter(0)
  %start.5 = s32[] constant(1)
  %copy.5 = s32[] copy(%start.5)
  %state.5 = (s32[], f32[8,16]{1,0}) tuple(%copy.5, %a.5)
  %while.5 = (s32[], f32[8,16]{1,0}) while(%state.5), condition=%chunk_cond, body=%chunk_body
  ROOT %r.5 = f32[8,16]{1,0} copy(%a.5)
}
"""


def test_collectives_after_a_multiline_instruction_count_with_loop_steps_and_starts():
  found = {c.name: c for c in collectives.parse(_HLO, [("data", 2), ("fsdp", 4)],
                                                slice_ids=[0] * 4 + [1] * 4)}
  # Everything after the custom call is read, each once per chunk (3: i = 1, 2, 3)...
  assert found["all-gather.3"].count == 3 and found["all-gather.3"].axes == ("fsdp",)
  send = found["send.3"]
  assert (send.kind, send.axes, send.count) == ("all-reduce", ("data",), 3)
  # ... and the ring loop inside runs 2 trips per chunk (i = 0, 2), not 4.
  for name in ("cp-start.1", "cp-start.2"):
    assert found[name].count == 3 * 2 and found[name].payload_bytes == 8 * 16 * 4
  # Each trip sends a shard both ways round the ring.
  sent = sum(c.ici_bytes * c.count for c in found.values() if c.kind == "collective-permute")
  assert sent == 3 * 2 * 2 * 8 * 16 * 4
  assert sum(c.dcn_bytes * c.count for c in found.values()) == pytest.approx(3 * 2 * 16 * 4)


def _loop(start: int, limit: int, direction: str, update: str) -> str:
  """An entry computation running one all-reduce in a while loop over a counter."""
  return f"""HloModule m, num_partitions=2

%body (p.1: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %p.1 = (s32[], f32[4]{{0}}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %x.1 = f32[4]{{0}} get-tuple-element(%p.1), index=1
  %all-reduce.1 = f32[4]{{0}} all-reduce(%x.1), channel_id=1, replica_groups={{{{0,1}}}}, to_apply=%add
  %step.1 = s32[] constant({abs(int(update))})
  %next.1 = s32[] {"add" if int(update) > 0 else "subtract"}(%i.1, %step.1)
  ROOT %t.1 = (s32[], f32[4]{{0}}) tuple(%next.1, %all-reduce.1)
}}

%cond (p.2: (s32[], f32[4])) -> pred[] {{
  %p.2 = (s32[], f32[4]{{0}}) parameter(0)
  %i.2 = s32[] get-tuple-element(%p.2), index=0
  %limit.2 = s32[] constant({limit})
  ROOT %c.2 = pred[] compare(%i.2, %limit.2), direction={direction}
}}

ENTRY %main (a.3: f32[4]) -> f32[4] {{
  %a.3 = f32[4]{{0}} parameter(0)
  %start.3 = s32[] constant({start})
  %state.3 = (s32[], f32[4]{{0}}) tuple(%start.3, %a.3)
  %while.3 = (s32[], f32[4]{{0}}) while(%state.3), condition=%cond, body=%body
  ROOT %r.3 = f32[4]{{0}} copy(%a.3)
}}
"""


@pytest.mark.parametrize("start, limit, direction, update, trips", [
    (0, 16, "LT", "+1", 16),
    (0, 16, "LT", "+2", 8),
    (0, 15, "LT", "+2", 8),   # i = 0, 2, ..., 14
    (3, 16, "LT", "+1", 13),
    (0, 16, "LE", "+4", 5),   # i = 0, 4, 8, 12, 16
    (10, 0, "GT", "-1", 10),
    (10, 0, "GE", "-5", 3),   # i = 10, 5, 0
    (0, 12, "NE", "+3", 4),
    (5, 5, "LT", "+1", 0),
])
def test_trip_count_reads_the_loop_counter(start, limit, direction, update, trips):
  (reduce,) = collectives.parse(_loop(start, limit, direction, update), [("data", 2)])
  assert reduce.count == trips


@pytest.mark.tpu_aot
def test_two_slices_count_each_layers_gradient_across_slices():
  """The CPU LM with splash attention (512 positions) on two v5e-8 slices: every layer's
  gradient all-reduce across slices sits in the backward layer loop after the splash kernel's
  custom call; all of them are counted (before the fix only those outside the loop were:
  0.05 MiB of 0.35 MiB)."""
  extras.require("libtpu")
  config = lm.get_config("cpu")
  config.data.update(seq_len=512, global_batch_size=16)
  config.model.compute_dtype = "bfloat16"
  report = aot.compile_report(config, target_lib.target_for("v5e-8", slices=2))
  assert report.run["attention"] == "splash"
  across = [c for c in report.collectives if c["dcn"] and c["kind"] == "all-reduce"]
  assert sum(c["executions"] for c in across) >= config.model.n_layers
  communication = report.communication
  assert communication["dcn_bytes_compiled"] >= 0.8 * communication["dcn_bytes_analytic"]


@pytest.mark.parametrize("tie", [False, True])
def test_gradients_cross_slices_in_the_dtype_they_come_in(tie):
  """The estimate's DCN bytes for data parallelism across 2 slices and fsdp 8 inside each: one
  all-reduce of each device's gradient shard across the slices (a hierarchical all-reduce
  sends the shard's bytes once for 2 slices), bfloat16 for the layers' weights and float32
  for the embedding tables, as the compiled 7b sends them (docs/compile.md)."""
  model = LlamaConfig.preset("7b", tie_embeddings=tie)  # float32 weights, bfloat16 compute
  shape = estimate.Shape(model=model, mesh_shape={"data": 2, "fsdp": 8, "tensor": 1},
                         dcn_shape={"data": 2}, rules=sharding.Rules.preset("fsdp"),
                         global_batch_size=16, seq_len=4096, microbatches=1,
                         param_bytes_per_device=0, param_count=model.num_params())
  tables = model.vocab_size * model.d_model * (1 if tie else 2)
  layers = model.num_params() - tables
  _, dcn = estimate.communication(shape)
  assert dcn == pytest.approx((layers * 2 + tables * 4) / 8)
