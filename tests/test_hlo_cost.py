"""The roofline estimate read off compiled TPU and GPU programs (lra_core/cost/hlo_cost.py), against exact
counts, against XLA's own estimate where XLA's is complete (no loops), and on GPU against the same
step compiled for the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import lra_core
import tiers
from lra_core import registry, sharding
from lra_core.compilation import aot_targets, topologies
from lra_core.cost import chips, hlo_cost, hlo_flops, hlo_text, pallas_costs, throughput

N, LAYERS = 1024, 6


@pytest.fixture(scope="module")
def v5e():
  if not topologies.libtpu_installed():
    pytest.skip("libtpu is not installed")
  devices = topologies.tpu_devices("v5e:2x2")
  return jax.sharding.Mesh(np.array(devices), ("x",)), chips.chip_of(devices[0])


def _gpu(topology):
  if not topologies.cuda_plugin_installed():
    pytest.skip(f"the CUDA plugin is not installed (the {topologies.GPU_EXTRA} extra)")
  devices = topologies.gpu_devices(topology)
  return jax.sharding.Mesh(np.array(devices), ("x",)), chips.chip_of(devices[0])


@pytest.fixture(scope="module")
def h100():
  return _gpu("h100")


@pytest.fixture(scope="module")
def v100():
  """No Triton on a V100 (compute capability 7.0): its matmuls are cuBLAS calls, its convolutions cuDNN's."""
  return _gpu("v100")


def _compile(fn, mesh, *shapes_and_specs, dtype=jnp.bfloat16):
  args = [
    jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
    for shape, spec in shapes_and_specs
  ]
  with jax.set_mesh(mesh):  # Pallas kernels lower for the mesh's devices (Triton on a GPU)
    return jax.jit(fn).lower(*args).compile()


def xla_flops(compiled) -> float:
  """XLA's own FLOP count of a compiled program (loop bodies once). A compile-only GPU executable has
  no cost analysis, so XLA's HloCostAnalysis runs over its optimized module through the CPU client:
  it counts the `dot`s of Triton GEMM fusions (and elementwise FLOPs), not library calls (cuBLAS)."""
  analysis = compiled.cost_analysis()
  if analysis is None:
    from jax._src.lib import _jax

    module = compiled.runtime_executable().hlo_modules()[0]
    analysis = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
  return float(analysis["flops"])


def _stack(w, x):
  return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]


def _unrolled(w, x):
  for i in range(LAYERS):
    x = jnp.tanh(x @ w[i])
  return x


def test_a_scan_counts_every_step_where_xla_counts_one(v5e):
  mesh, chip = v5e
  shapes = (((LAYERS, N, N), jax.sharding.PartitionSpec()), ((N, N), jax.sharding.PartitionSpec()))
  exact = 2.0 * N**3 * LAYERS
  scanned, unrolled = _compile(_stack, mesh, *shapes), _compile(_unrolled, mesh, *shapes)
  assert scanned.cost_analysis()["flops"] == pytest.approx(exact / LAYERS, rel=0.02)  # the loop body, once
  ours = {name: hlo_cost.roofline(c.as_text(), chip) for name, c in (("scan", scanned), ("unrolled", unrolled))}
  for roof in ours.values():
    assert roof.flops == pytest.approx(exact, rel=1e-6)
    assert roof.unknown_loops == 0
  assert ours["scan"].seconds == pytest.approx(ours["unrolled"].seconds, rel=0.25)


@pytest.mark.parametrize("start, direction, trips", [(0, "LT", 4), (1, "LT", 3), (1, "LE", 4)])
def test_a_loop_whose_first_iteration_was_peeled_counts_the_iterations_it_runs(start, direction, trips):
  """XLA peels a scan's first backward step out of its loop, which then counts from 1: a trip count read
  off the condition's bound alone counted one step twice (seen in a 36-layer step compiled for TPU)."""
  hlo = f"""
HloModule m

%body (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {{
  %p = (s32[], f32[64,64]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,64]{{1,0}} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[64,64]{{1,0}} dot(%x, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %t = (s32[], f32[64,64]{{1,0}}) tuple(%next, %y)
}}

%cond (p: (s32[], f32[64,64])) -> pred[] {{
  %p = (s32[], f32[64,64]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction={direction}
}}

ENTRY %main (x: f32[64,64]) -> (s32[], f32[64,64]) {{
  %x = f32[64,64]{{1,0}} parameter(0)
  %start = s32[] constant({start})
  %counter = s32[] copy(%start)
  %init = (s32[], f32[64,64]{{1,0}}) tuple(%counter, %x)
  ROOT %w = (s32[], f32[64,64]{{1,0}}) while(%init), condition=%cond, body=%body
}}
"""
  roof = hlo_cost.roofline(hlo, chips.CHIPS["TPU v5 lite"])
  assert roof.flops == trips * 2 * 64**3 and roof.unknown_loops == 0


def test_hotspots_count_a_loop_body_operation_once_per_step_of_the_loop(v5e):
  mesh, chip = v5e
  shapes = (((LAYERS, N, N), jax.sharding.PartitionSpec()), ((N, N), jax.sharding.PartitionSpec()))
  roof = hlo_cost.roofline(_compile(_stack, mesh, *shapes).as_text(), chip, top=3)
  top = roof.hotspots[0]
  # The layer's N x N x N matmul, run LAYERS times, is the whole cost and compute-bound.
  assert top.executions == LAYERS and top.flops == pytest.approx(2.0 * N**3 * LAYERS, rel=1e-6)
  assert top.bound == "compute" and top.seconds <= roof.seconds
  assert sum(h.seconds for h in roof.hotspots) <= roof.compute_s * (1 + 1e-9)
  assert hlo_cost.roofline(_compile(_stack, mesh, *shapes).as_text(), chip).hotspots == ()


def test_the_step_splits_into_matmuls_in_place_updates_and_elementwise_work(v5e):
  """A scanned stack that keeps every layer's input (as a scanned stack keeps its residuals for the
  backward pass): its matmuls run at peak, storing each input into the stacked result is an in-place
  update per layer, copies are elementwise work; the kinds add up to the whole estimate."""
  mesh, chip = v5e

  def keep_outputs(w, x):
    def layer(h, wi):
      return jnp.tanh(h @ wi), h

    h, inputs = jax.lax.scan(layer, x, w)
    return inputs, h

  shapes = (((LAYERS, N, N), jax.sharding.PartitionSpec()), ((N, N), jax.sharding.PartitionSpec()))
  roof = hlo_cost.roofline(_compile(keep_outputs, mesh, *shapes).as_text(), chip, top=10_000, split=True)
  split = dict(roof.split)
  assert sum(split.values()) == pytest.approx(roof.compute_s, rel=1e-9)
  assert [kind for kind, _ in roof.split][0] == "matmuls compute-bound"
  assert split["matmuls compute-bound"] == pytest.approx(2.0 * N**3 * LAYERS / chip.peak_flops, rel=1e-6)
  # Each layer writes its N x N bf16 input once, in place (the update read and written).
  assert split["in-place updates"] == pytest.approx(2 * (N * N * 2) * LAYERS / chip.hbm_bandwidth, rel=1e-6)
  assert "elementwise" in split
  assert {h.category for h in roof.hotspots} <= set(hlo_cost.SPLIT)
  # The same kinds read off the hotspots (every operation listed) as off the split.
  updates = sum(h.seconds for h in roof.hotspots if h.category == "in-place updates")
  assert updates == pytest.approx(split["in-place updates"], rel=1e-9)
  assert hlo_cost.roofline(_compile(keep_outputs, mesh, *shapes).as_text(), chip).split == ()


def test_the_split_itemizes_the_dearest_branch_of_a_conditional(v5e):
  """A layer that runs its matmul or skips it by a run-time flag (as ring attention skips a key piece
  no query reads): the estimate and its split count the dearest branch, the matmul, every layer."""
  mesh, chip = v5e

  def maybe(w, x):
    def layer(h, wi):
      return jax.lax.cond(jnp.sum(h) > 0, lambda: jnp.tanh(h @ wi), lambda: h), None

    return jax.lax.scan(layer, x, w)[0]

  shapes = (((LAYERS, N, N), jax.sharding.PartitionSpec()), ((N, N), jax.sharding.PartitionSpec()))
  roof = hlo_cost.roofline(_compile(maybe, mesh, *shapes).as_text(), chip, top=10_000, split=True)
  split = dict(roof.split)
  assert roof.flops == pytest.approx(2.0 * N**3 * LAYERS, rel=1e-6)
  assert split["matmuls compute-bound"] == pytest.approx(2.0 * N**3 * LAYERS / chip.peak_flops, rel=1e-6)
  assert split.get("other", 0.0) < 1e-3 * roof.compute_s, split


def test_a_loop_writing_one_row_at_a_time_moves_rows_not_the_buffer(v5e):
  """XLA updates a buffer in place: a loop that reads and writes one row per step moves about two
  rows per step, not the whole buffer per step (which would be `rows` times more)."""
  mesh, chip = v5e
  rows, width = 1024, 4096

  def fill(buf):
    def step(i, b):
      row = jax.lax.dynamic_index_in_dim(b, i, keepdims=False)
      return jax.lax.dynamic_update_index_in_dim(b, jnp.tanh(row) * 2, i, 0)

    return jax.lax.fori_loop(0, rows, step, buf)

  roof = hlo_cost.roofline(_compile(fill, mesh, ((rows, width), jax.sharding.PartitionSpec())).as_text(), chip)
  buffer = rows * width * 2
  assert roof.unknown_loops == 0
  assert 2 * buffer <= roof.hbm_bytes <= 10 * buffer  # rows x (a row in, a row out), plus copies in and out


def test_remat_recomputation_is_counted_apart(v5e):
  """With every layer rematerialised, the backward pass reruns each layer's forward matmul: one of
  the four N^3 matmuls per layer (forward, recomputed forward, two in the backward) is recomputation."""
  mesh, chip = v5e
  layer = jax.checkpoint(lambda h, wi: jnp.tanh(h @ wi))
  loss = lambda w, x: jax.lax.scan(lambda h, wi: (layer(h, wi), None), x, w)[0].astype(jnp.float32).sum()
  shapes = (((LAYERS, N, N), jax.sharding.PartitionSpec()), ((N, N), jax.sharding.PartitionSpec()))
  roof = hlo_cost.roofline(_compile(jax.grad(loss), mesh, *shapes).as_text(), chip)
  unit = 2.0 * N**3 * LAYERS
  assert roof.flops == pytest.approx(4 * unit, rel=1e-6)
  assert roof.recompute_flops == pytest.approx(unit, rel=1e-6)
  plain = jax.grad(lambda w, x: jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0].astype(jnp.float32).sum())
  assert hlo_cost.roofline(_compile(plain, mesh, *shapes).as_text(), chip).recompute_flops == 0


def test_a_scanned_backward_reads_one_layer_of_its_stacked_residuals_per_step(v5e):
  """The backward scan slices the forward's stacked residuals [LAYERS, ...] one layer per step (in
  fusions nested in fusions): its traffic stays near the unrolled backward's."""
  mesh, chip = v5e
  shapes = (((LAYERS, N, N), jax.sharding.PartitionSpec()), ((N, N), jax.sharding.PartitionSpec()))
  loss = lambda f: jax.grad(lambda w, x: f(w, x).astype(jnp.float32).sum())
  scanned, unrolled = (hlo_cost.roofline(_compile(loss(f), mesh, *shapes).as_text(), chip) for f in (_stack, _unrolled))
  assert scanned.flops == pytest.approx(unrolled.flops, rel=0.1)  # XLA may fuse the two a little differently
  # Stacking residuals and gradient slices is real extra traffic of a scan (2.2x here); reading whole
  # stacks in the nested fusions made it 2.8x.
  assert scanned.hbm_bytes < 2.5 * unrolled.hbm_bytes


def test_without_loops_the_estimate_agrees_with_xla(v5e):
  mesh, chip = v5e
  rows = jax.sharding.PartitionSpec("x")
  compiled = _compile(lambda a: jnp.tanh(a @ a.T), mesh, ((4 * N, N), rows))
  xla = compiled.cost_analysis()
  roof = hlo_cost.roofline(compiled.as_text(), chip)
  assert roof.flops == pytest.approx(xla["flops"], rel=0.01)
  assert roof.seconds == pytest.approx(xla["optimal_seconds"], rel=0.35)
  # The all-gather of the sharded rows is interconnect traffic: 3 of the 4 shards come in.
  assert roof.comm_bytes >= 3 * N * N * 2


def test_parse_reads_shapes_tuples_and_layouts():
  text = """HloModule m

%body (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %p = (s32[]{:T(128)}, bf16[4,8]{1,0:T(8,128)(2,1)}) parameter(0)
  ROOT %t = (s32[], bf16[4,8]) tuple(%p, %p)
}

%cond (q: (s32[], bf16[4,8])) -> pred[] {
  %c = s32[]{:T(128)} constant(7)
  %q = (s32[], bf16[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: bf16[4,8]) -> bf16[4,8] {
  %a = bf16[4,8]{1,0} parameter(0)
  %w = (s32[], bf16[4,8]) while(%a), condition=%cond, body=%body
  ROOT %d = bf16[4,4]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""
  computations, entry = hlo_text.parse(text)
  assert entry == "main" and set(computations) == {"body", "cond", "main"}
  assert hlo_text.size_bytes("(s32[]{:T(128)}, bf16[4,8]{1,0:T(8,128)(2,1)})") == 4 + 64
  chip = chips.CHIPS["TPU v5 lite"]
  roof = hlo_cost.roofline(text, chip)
  assert roof.flops == 2 * 4 * 4 * 8 and roof.unknown_loops == 0


def test_an_operation_printed_over_several_lines_is_read_whole():
  """A TPU kernel's kernel_metadata runs over lines and its op_name follows them; a Triton kernel's
  serialized module holds stray braces on one line: neither swallows or loses an operation."""
  text = """HloModule m

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %k = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512}"
}}, metadata={op_name="jit(f)/rematted_computation/kernel/pallas_call"}
  %g = f32[8]{0} custom-call(%k), custom_call_target="__gpu$xla.gpu.triton", backend_config={ir = "\\7B{{\\01"}
  ROOT %n = f32[8]{0} negate(%g)
}
"""
  ops = hlo_text.parse(text)[0]["main"]
  assert [o.name for o in ops] == ["a", "k", "g", "n"] and ops[-1].root
  assert hlo_text.op_name(ops[1]) == "jit(f)/rematted_computation/kernel/pallas_call"


# Convolutions from programs compiled for TPU v4 (jax 0.10.2, libtpu 0.0.42.1), metadata cut: the line,
# its operands' shapes, and the multiply-adds that meet input data, counted by hand.
TPU_CONVOLUTIONS = {
  # einsum('btd,dhk->bthk') with b 4, t 128, d 768, 12 heads of 64: a window as wide as the heads,
  # padded 11 on each side, so each of the 12 outputs meets the input with one tap of 12.
  "head-split projection": (
    "%c = bf16[4,128,12,64]{3,2,1,0} convolution(%x, %w), window={size=1x12 pad=0_0x11_11 rhs_reversal=0x1}, "
    "dim_labels=0bf1_i1o0->0b1f",
    ("bf16[4,128,768,1]", "bf16[768,12,64,1]"),
    4 * 128 * 768 * 12 * 64,
  ),
  # its weight gradient: the window runs over the batch (4 taps, all data) and the heads (padded, 1 of 12)
  "head-split weight gradient": (
    "%c = bf16[768,12,64,1]{3,2,1,0} convolution(%x, %g), window={size=12x4 pad=11_11x0_0 rhs_reversal=1x0}, "
    "dim_labels=1fb0_1i0o->b0f1",
    ("bf16[4,128,768,1]", "bf16[4,128,12,64]"),
    4 * 128 * 768 * 12 * 64,
  ),
  # a depthwise causal convolution of width 4 dilated by 2 over 128 features (feature_group_count):
  # 16 rows of 15 inputs (the causal padding already in the data), 9 outputs, every tap on data
  "rhs_dilate, feature groups": (
    "%c = f32[16,9,128]{2,1,0} convolution(%x, %k), window={size=4 rhs_dilate=2}, dim_labels=b0f_0io->b0f, "
    "feature_group_count=128",
    ("bf16[16,15,128]", "f32[4,1,128]"),
    16 * 9 * 128 * 4,
  ),
  # its filter gradient (batch_group_count): for tap w of 4 the positions t of 64 with t >= 2 (3 - w)
  # meet data, the window's other taps fall on the 6 padded positions (stride 2: the rhs dilation)
  "stride, padding, batch groups": (
    "%c = f32[4,1,128]{2,1,0} convolution(%x, %g), window={size=64 stride=2 pad=6_0}, "
    "dim_labels=f0b_i0o->0bf, batch_group_count=128",
    ("bf16[2,64,128]", "bf16[2,64,128]"),
    128 * 2 * (58 + 60 + 62 + 64),
  ),
  # einsum('bij,bjk->bik') with b 4: the batch is a window of 4 dilated by 4, one tap per output on data
  "lhs_dilate, stride": (
    "%c = f32[4,1536,512]{1,2,0} convolution(%x, %y), window={size=4 stride=3 lhs_dilate=4}, dim_labels=0fb_0oi->0bf",
    ("f32[4,1024,512]", "f32[4,1536,1024]"),
    4 * 512 * 1024 * 1536,
  ),
}


@pytest.mark.parametrize("form", TPU_CONVOLUTIONS)
def test_a_convolution_counts_the_taps_that_meet_input_data(form):
  line, (x, y), multiply_adds = TPU_CONVOLUTIONS[form]
  op = hlo_text.parse_op(line)
  assert hlo_flops.matmul_flops(op, dict(zip(op.operands, (x, y)))) == 2 * multiply_adds


@given(
  input_size=st.integers(1, 12),
  size=st.integers(1, 9),
  outputs=st.integers(1, 14),
  stride=st.integers(1, 5),
  pad_low=st.integers(-3, 12),
  lhs_dilate=st.integers(1, 6),
  rhs_dilate=st.integers(1, 4),
)
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
def test_real_taps_equal_counting_them_one_by_one(input_size, size, outputs, stride, pad_low, lhs_dilate, rhs_dilate):
  last = (input_size - 1) * lhs_dilate
  taps = [o * stride + k * rhs_dilate - pad_low for o in range(outputs) for k in range(size)]
  want = sum(0 <= p <= last and p % lhs_dilate == 0 for p in taps)
  assert (
    hlo_flops.real_taps(
      input_size=input_size,
      size=size,
      outputs=outputs,
      stride=stride,
      pad_low=pad_low,
      lhs_dilate=lhs_dilate,
      rhs_dilate=rhs_dilate,
    )
    == want
  )


def test_slices_move_their_window_not_the_whole_operand():
  """A static slice and an asynchronous slice-start (result: (operand), window, context) read and
  write the window; counting the operand made a batch split into 4 windows cost 9 windows."""
  text = """HloModule m

ENTRY %main (a: bf16[16,512,256]) -> bf16[4,512,256] {
  %a = bf16[16,512,256]{2,1,0} parameter(0)
  %s = bf16[4,512,256]{2,1,0} slice(%a), slice={[0:4], [0:512], [0:256]}
  %ss = ((bf16[16,512,256]{2,1,0}), bf16[4,512,256]{2,1,0:S(3)}, s32[]{:S(2)}) slice-start(%a), slice={[4:8], [0:512], [0:256]}
  %sd = bf16[4,512,256]{2,1,0:S(3)} slice-done(%ss)
  ROOT %r = bf16[4,512,256]{2,1,0} add(%s, %sd)
}
"""
  window = 4 * 512 * 256 * 2
  roof = hlo_cost.roofline(text, chips.CHIPS["TPU v5 lite"])
  assert roof.hbm_bytes == 2 * window + 2 * window + 3 * window  # slice, slice-start, the add


# ----------------------------------------------------------------------------- XLA:GPU programs


def test_on_gpu_a_scan_counts_every_step_and_the_unrolled_stack_agrees_with_xla(h100):
  """XLA:GPU writes the matmuls as Triton GEMM fusions (a `dot` inside): counted inside loops by trip count."""
  mesh, chip = h100
  shapes = (((LAYERS, N, N), jax.sharding.PartitionSpec()), ((N, N), jax.sharding.PartitionSpec()))
  exact = 2.0 * N**3 * LAYERS
  scanned, unrolled = _compile(_stack, mesh, *shapes), _compile(_unrolled, mesh, *shapes)
  assert "__triton_gemm" in unrolled.as_text() or "__triton_nested_gemm_fusion" in unrolled.as_text()
  for compiled in (scanned, unrolled):
    roof = hlo_cost.roofline(compiled.as_text(), chip)
    assert roof.flops == pytest.approx(exact, rel=1e-6) and roof.unknown_loops == 0
  assert xla_flops(unrolled) == pytest.approx(exact, rel=0.01)  # XLA adds tanh's N^2 per layer


def test_cublas_gemms_and_cudnn_convolutions_count_their_flops(v100):
  """Without Triton (V100) a matmul is a `__cublas$lt$matmul` call and a depthwise convolution cuDNN
  calls, forward and backward; their workspace is scratch, not traffic."""
  mesh, chip = v100
  b, t, d, width = 4, 512, 1024, 4

  def loss(w, x, k):
    h = jnp.tanh(x @ w)
    c = jax.lax.conv_general_dilated(
      h, k, (1,), [(width - 1, 0)], dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=d
    )
    return (c * c).sum()

  rep = jax.sharding.PartitionSpec()
  compiled = _compile(
    jax.grad(loss, argnums=(0, 2)), mesh, ((d, d), rep), ((b, t, d), rep), ((width, 1, d), rep), dtype=jnp.float32
  )
  text = compiled.as_text()
  assert "__cublas$" in text and "__cudnn$conv" in text
  matmuls = 2 * (2.0 * b * t * d * d)  # x @ w and the gradient of w
  convs = 2.0 * b * t * d * width  # each depthwise pass: one multiply-add per tap per output
  flops = hlo_cost.roofline(text, chip).flops
  # The forward convolution, its gradient by the filter and by the input (which reaches w's gradient).
  assert flops == pytest.approx(matmuls + 3 * convs, rel=1e-6)


def _pallas_matmul(x, y):
  m, k = x.shape
  n = y.shape[1]

  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)

  return pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
    grid=(m // 64, n // 64),
    in_specs=[pl.BlockSpec((64, k), lambda i, j: (i, 0)), pl.BlockSpec((k, 64), lambda i, j: (0, j))],
    out_specs=pl.BlockSpec((64, 64), lambda i, j: (i, j)),
    compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),  # Triton, not Mosaic GPU
    cost_estimate=pl.CostEstimate(flops=2 * m * n * k, transcendentals=0, bytes_accessed=2 * (m * k + k * n + m * n)),
    name="test_matmul",
  )(x, y)


def test_a_triton_kernel_takes_the_cost_its_pallas_call_declares(h100):
  """Pallas' Triton lowering keeps no cost estimate in the GPU program: the traced jaxpr's does, matched
  by kernel name and operand shapes; in a loop it counts once per step."""
  mesh, chip = h100
  m = 256
  fn = lambda w, x: jax.lax.scan(lambda h, wi: (jnp.tanh(_pallas_matmul(h, wi)), None), x, w)[0]
  rep = jax.sharding.PartitionSpec()
  args = [
    jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, rep))
    for s in ((LAYERS, m, m), (m, m))
  ]
  with jax.set_mesh(mesh):
    traced = jax.jit(fn).trace(*args)
    compiled = traced.lower().compile()
  text = compiled.as_text()
  assert text.count(pallas_costs.TRITON_CALL) == 1 and "cost_estimate" not in text
  costs = pallas_costs.pallas_kernel_costs(traced.jaxpr)
  assert [(c.name, c.operands, c.flops) for c in costs] == [("test_matmul", ("bf16[256,256]",) * 2, 2.0 * m**3)]
  roof = hlo_cost.roofline(text, chip, kernel_costs=costs)
  assert roof.flops == pytest.approx(LAYERS * 2.0 * m**3) and roof.undeclared_kernels == 0
  bare = hlo_cost.roofline(text, chip)
  assert bare.flops == 0 and bare.undeclared_kernels == 1


# Both targets compile the same attention: on TPU and GPU "auto" would take a library flash kernel, a
# custom call whose FLOPs the HLO does not show (kernels/softmax/library.py).
XLA = "model.attention_impl=xla"


def compiled_train_step(config, devices):
  """The trainer's train step of `config` alone compiled for `devices`: (compiled, traced)."""
  mesh, _, _, traced = aot_targets.trace_train_step(config, devices)
  with jax.set_mesh(mesh), sharding.activate(mesh, config.sharding.rules):
    return traced.lower().compile(), traced


@pytest.mark.parametrize(
  "spec, overrides, against_xla",
  [
    # A small Transformer whose matmuls dominate, layers unrolled so that XLA's count (loop bodies
    # once) is complete: XLA also counts elementwise FLOPs (3% here), hlo_cost only matmuls.
    pytest.param(
      "configs/c4/transformer.py:tiny",
      ["model.d_model=256", "model.d_ff=1024", "model.num_heads=4"],
      True,
      marks=pytest.mark.slow,
    ),
    # Latte's Pallas kernels, forward and backward: Triton calls on the GPU (their declared costs), interpreted
    # on the CPU (the matmuls of their block steps). Bidirectional Latte, whose kernels' matmuls are nearly all they
    # declare; the causal kernels also declare their elementwise block weights, which the CPU's count leaves
    # out (configs/c4/latte.py:tiny: 71.0 MFLOP on the GPU against 68.1 on the CPU, 4% apart).
    pytest.param("configs/lra/listops/latte.py:tiny", ["model.impl=pallas"], False, marks=pytest.mark.slow),
  ],
)
def test_a_train_step_has_the_same_flops_compiled_for_a_gpu_and_for_the_cpu(h100, spec, overrides, against_xla):
  """The same config and per-device batch: XLA:GPU's program (cuBLAS / Triton GEMMs, Triton Pallas calls)
  counts the FLOPs of the CPU's program within 2% (XLA:GPU pads some matmul dimensions, e.g. a
  vocabulary of 258 to 288, and runs the padding) and XLA's own count within 5%."""
  config = lra_core.load_config(
    spec, overrides + ["model.dtype=bfloat16", "model.scan_layers=False", "mesh.data=1", XLA]
  )
  gpu, traced = compiled_train_step(config, h100[0].devices.flat[:1].tolist())
  cpu, _ = compiled_train_step(config, jax.devices("cpu")[:1])
  costs = pallas_costs.pallas_kernel_costs(traced.jaxpr)
  assert bool(costs) == ("pallas" in " ".join(overrides))
  on_gpu, _ = hlo_cost.step_flops(gpu.as_text(), costs)
  on_cpu, _ = hlo_cost.step_flops(cpu.as_text())
  assert on_gpu == pytest.approx(on_cpu, rel=0.02)
  # The trainer's MFU counts the same: with the traced step, the Pallas kernels' FLOPs too
  assert throughput.model_flops(gpu, 1, traced) == on_gpu
  if costs:
    assert throughput.model_flops(gpu, 1) < on_gpu
  if against_xla:
    assert on_gpu == pytest.approx(xla_flops(gpu), rel=0.05)


# Every registered family at a paper config's width with one layer (FIT: one local and one global
# block), bfloat16, layers unrolled, on one sequence: 256 tokens (the TPU compile takes about 60% of a
# 512-token one's time), also for Transformer-VQ (one block of 256: 6.4 s against 10.2 s at its paper
# block of 512); 512 for the Block Transformer (whose elementwise share grows to 5% at 256); the image
# models one 16x16 image, four of their 8x8 patches (FIT-AR's TPU compile: 6.5 s against 32 s for a
# 32x32 image). The C4 Transformer's, Latte's and FLASH's output layer covers 1,024 ids rather than C4's
# 32,128: a plain product either way, and at the full vocabulary over 40% of the Transformer's TPU compile
# (10.4 s against 5.7 s with 512 ids); Combiner and the Block Transformer keep theirs (2.8 s and 0.75 s to
# gain), whose product holds their elementwise shares under the tolerances below (with 1,024 ids: 3.0% and
# 4.8%). XLA also counts elementwise arithmetic, which a matmul count leaves out: 2.3-2.7% of these steps
# at 256 tokens. Where it is more, the measured share sets the tolerance: the linear
# Transformer's causal form builds k (x) v for every position and sums them running (elementwise, 18% at
# the 128 tokens it is compiled with: its TPU compile takes 2/3 of a 256-token one's time);
# the Block Transformer's C4 5M model is 256 wide (3.3%); FIT-AR on four patches (3.2%); FIT's denoiser
# adds the diffusion's per-pixel arithmetic to a one-layer step (8.4% without self-conditioning, whose
# second pass through the same layers adds a fifth to the TPU compile and nothing to count).
SMALL_IMAGE = ["data.image_size=16", "train.seq_len=768"]
ONE, SHORT, BLOCK = "model.num_layers=1", "train.seq_len=256", "train.seq_len=512"
VOCAB = "model.vocab_size=1024"
FAMILY_STEPS = [
  ("transformer", "configs/c4/transformer.py:mlm", [ONE, SHORT, VOCAB], 0.03),
  (
    "transformer_vq",
    "configs/enwik8/transformer_vq.py",
    [ONE, SHORT, "train.update_len=256", "model.block_len=256"],
    0.03,
  ),
  ("latte", "configs/c4/latte.py", [ONE, SHORT, VOCAB], 0.03),
  ("flash", "configs/c4/flash.py", [ONE, SHORT, VOCAB], 0.03),
  ("combiner", "configs/c4/combiner.py", [ONE, SHORT], 0.03),
  ("linear_transformer", "configs/enwik8/linear_transformer.py", [ONE, "train.seq_len=128"], 0.22),
  ("block_transformer", "configs/c4/block_transformer.py:5m", [ONE, "model.encoder_layers=1", BLOCK], 0.04),
  ("fit", "configs/imagenet64/fit_ar.py", ["model.layers=L(1)G(1)", *SMALL_IMAGE], 0.04),
  (
    "fit_denoiser",
    "configs/imagenet64/fit_denoiser.py",
    ["model.layers=L(0)G(1)L(1)", "model.image_size=16", "model.self_condition=False", *SMALL_IMAGE],
    0.10,
  ),
]


def test_the_cross_check_covers_every_family():
  assert {family for family, *_ in FAMILY_STEPS} == set(registry.family_names())


@pytest.mark.parametrize(
  "family, spec, overrides, elementwise",
  tiers.quick(FAMILY_STEPS, keep=[0], ids=lambda case: case[1].removeprefix("configs/")),
)
def test_a_train_step_has_the_same_flops_compiled_for_a_tpu_and_for_the_cpu(family, spec, overrides, elementwise):
  """The same per-device batch compiled for TPU v4 and for the CPU counts the same FLOPs within 3%
  (the TPU compiler writes head-split projections and batched matmuls as padded and dilated
  convolutions: counting every tap of those windows once made the Transformer's step 1.75x the CPU's),
  and the CPU's count is XLA's own less the elementwise arithmetic XLA also counts."""
  config = lra_core.load_config(
    spec, overrides + ["train.batch_size=1", "model.dtype=bfloat16", "model.scan_layers=False", "mesh.data=1", XLA]
  )
  assert config.model.name == family
  if not topologies.libtpu_installed():
    pytest.skip("libtpu is not installed")
  tpu, _ = compiled_train_step(config, topologies.tpu_devices("v4:2x2x1")[:1])
  cpu, _ = compiled_train_step(config, jax.devices("cpu")[:1])
  on_tpu, on_cpu = (hlo_cost.step_flops(c.as_text())[0] for c in (tpu, cpu))
  assert on_tpu == pytest.approx(on_cpu, rel=0.03)
  assert 1 - elementwise <= on_cpu / xla_flops(cpu) <= 1.0


def test_collectives_across_the_sequence_axis_are_counted_on_their_own():
  """Device groups in XLA's three forms (explicit, iota, compiler mesh) and collective-permute pairs,
  on a data 2 x sequence 4 mesh (devices in order, sequence the faster axis)."""
  lines = {
    "%a = f32[64]{0} all-reduce(f32[64]{0} %p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add": [
      [0, 1, 2, 3],
      [4, 5, 6, 7],
    ],
    "%b = f32[64]{0} all-reduce(f32[64]{0} %p), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add": [
      [0, 4],
      [1, 5],
      [2, 6],
      [3, 7],
    ],
    "%c = f32[64]{0} all-reduce(f32[64]{0} %p), replica_groups=mesh['x'=2,'y'=4] {'y'}, to_apply=%add": [
      [0, 1, 2, 3],
      [4, 5, 6, 7],
    ],
    "%d = f32[64]{0} collective-permute(f32[64]{0} %p), source_target_pairs={{0,1},{1,2},{2,3}}": [
      [0, 1],
      [1, 2],
      [2, 3],
    ],
  }
  for line, groups in lines.items():
    assert hlo_text.device_groups(hlo_text.parse_op(line)) == groups, line
  chip = chips.CHIPS["TPU v5"]
  mesh = (("data", 2), ("fsdp", 1), ("sequence", 4), ("tensor", 1))
  module = "HloModule m\n\nENTRY %main (p: f32[64]) -> f32[64] {{\n  %p = f32[64]{{0}} parameter(0)\n  ROOT {}\n}}\n"
  across = [line for line, groups in lines.items() if len({i % 4 for i in groups[0]}) > 1]
  assert len(across) == 3  # the groups of %b keep the sequence place and cross data only
  # An asynchronous permute's result holds its operand, its result and two sync flags: 256 bytes move, not 512.
  start = (
    "%e = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(f32[64]{0} %p), source_target_pairs={{0,1}}"
  )
  assert hlo_cost.roofline(module.format(start), chip, mesh=mesh).comm_bytes == 256
  for line in lines:
    roof = hlo_cost.roofline(module.format(line), chip, mesh=mesh)
    assert roof.comm_bytes > 0
    assert roof.sequence_comm_bytes == (roof.comm_bytes if line in across else 0.0), line
    assert hlo_cost.roofline(module.format(line), chip).sequence_comm_bytes == 0.0  # no mesh given: not told apart
