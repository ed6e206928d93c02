"""The grid model of a Pallas call (lra_core/cost/pallas_grid.py): programs, work and traffic read off the
traced call, counted by hand here; the time in waves of programs with a latency per serial step."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from lra_core.bench import gpu_compile
from lra_core.compilation import topologies
from lra_core.cost import chips, hlo_cost, pallas_costs, pallas_grid
from lra_core.kernels import catalog, latte, toolkit

H100 = topologies.GPUS["h100"]


def _matmul_kernel(x_ref, y_ref, o_ref, *, precision):
  o_ref[...] = jax.lax.dot_general(
    x_ref[...], y_ref[...], (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
  )


def _traced_matmul(dtype, precision=None):
  """[64,32] x [32,24] in blocks of [16,32] x [32,8]: grid (4, 3)."""
  call = pl.pallas_call(
    functools.partial(_matmul_kernel, precision=precision),
    out_shape=jax.ShapeDtypeStruct((64, 24), jnp.float32),
    grid=(4, 3),
    in_specs=[pl.BlockSpec((16, 32), lambda i, j: (i, 0)), pl.BlockSpec((32, 8), lambda i, j: (0, j))],
    out_specs=pl.BlockSpec((16, 8), lambda i, j: (i, j)),
    interpret=True,
    name="blocked_matmul",
  )
  x, y = jax.ShapeDtypeStruct((64, 32), dtype), jax.ShapeDtypeStruct((32, 24), dtype)
  return jax.make_jaxpr(call)(x, y)


def test_a_blocked_matmul_is_its_programs_products_and_blocks():
  (cost,) = pallas_grid.grid_costs(_traced_matmul(jnp.bfloat16))
  assert cost.name == "blocked_matmul" and cost.grid == (4, 3) and cost.programs == 12
  assert cost.operands == ("bf16[64,32]", "bf16[32,24]")
  assert cost.work.tensor_flops == 2 * 16 * 8 * 32 and cost.work.fma_flops == 0
  assert cost.work.steps == 1  # no loop
  assert cost.block_bytes == (16 * 32 + 32 * 8) * 2 + 16 * 8 * 4  # each program's blocks, read and written once
  assert cost.flops == 2 * 64 * 24 * 32  # all programs: the whole product


def test_float32_products_at_highest_precision_are_fmas_others_tensor_core_work():
  highest = pallas_grid.grid_costs(_traced_matmul(jnp.float32, jax.lax.Precision.HIGHEST))[0].work
  default = pallas_grid.grid_costs(_traced_matmul(jnp.float32))[0].work
  assert highest.fma_flops == default.tensor_flops == 2 * 16 * 8 * 32
  assert highest.tensor_flops == default.fma_flops == 0


def _loop_kernel(x_ref, o_ref, *, steps):
  def body(i, acc):
    return acc + jnp.exp(x_ref[...] * i.astype(jnp.float32))

  o_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))


@pytest.mark.parametrize("steps", [1, 7])
def test_a_loop_counts_its_trip_count_in_work_and_serial_steps(steps):
  call = pl.pallas_call(
    functools.partial(_loop_kernel, steps=steps),
    out_shape=jax.ShapeDtypeStruct((8, 16), jnp.float32),
    grid=(2,),
    in_specs=[pl.BlockSpec((8, 16), lambda i: (0, 0))],
    out_specs=pl.BlockSpec((8, 16), lambda i: (0, 0)),
    interpret=True,
  )
  (cost,) = pallas_grid.grid_costs(jax.make_jaxpr(call)(jax.ShapeDtypeStruct((8, 16), jnp.float32)))
  assert cost.work.steps == steps
  assert cost.work.transcendentals == steps * 8 * 16  # one exp per element per step
  assert cost.work.vector_ops >= steps * 2 * 8 * 16  # the product and the sum, per element per step


def test_programs_run_in_waves_of_one_per_sm_with_a_latency_per_serial_step():
  """Up to one program per SM the time is one program's; twice the SMs, twice that; a serial step adds one
  memory latency to each program."""
  work = pallas_grid.Work(fma_flops=1e6, steps=10)
  cost = lambda programs, w=work: pallas_grid.GridCost("k", (), (programs,), w, block_bytes=1e5)
  seconds = functools.partial(pallas_grid.gpu_seconds, gpu=H100, tensor_flops_per_s=989e12, hbm_bandwidth=3.35e12)
  one = seconds(cost(1))
  assert seconds(cost(H100.sms)) == one
  assert seconds(cost(H100.sms + 1)) == seconds(cost(2 * H100.sms)) == 2 * one
  fma_s = 1e6 / (2 * H100.fp32_lanes_per_sm * H100.clock_ghz * 1e9)
  assert one == pytest.approx(max(fma_s, 1e5 / (3.35e12 / H100.sms)) + 10 * pallas_grid.MEMORY_LATENCY_S)
  longer = pallas_grid.Work(fma_flops=1e6, steps=20)
  assert seconds(cost(1, longer)) - one == pytest.approx(10 * pallas_grid.MEMORY_LATENCY_S)
  assert seconds(cost(3 * H100.sms)) == 3 * one


@pytest.mark.skipif(not topologies.cuda_plugin_installed(), reason="the CUDA plugin is not installed")
def test_causal_latte_traced_for_an_h100_is_a_program_per_value_tile_walking_the_time_blocks():
  """Causal Latte's forward and its two backward kernels traced for the H100 (the loop driver): B x H x D / 32
  programs (`toolkit.GPU_TILES`' value_block), each walking T / 16 blocks in order (its chunk)."""
  b, t, h, l, d = 2, 256, 4, 16, 64
  x, v = jax.ShapeDtypeStruct((b, t, h, l), jnp.float32), jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)
  fn = catalog.gradient(lambda q, k, v: latte.causal_latte(q, k, v, impl="pallas"))
  traced = gpu_compile.traced_for_gpu(fn, (x, x, v), topologies.gpu_devices("h100"))
  costs = {c.name: c for c in pallas_grid.grid_costs(traced.jaxpr)}
  assert set(costs) == {"causal_latte", "causal_latte_backward_dp", "causal_latte_backward"}
  tiles = toolkit.gpu_tiles("causal_latte")
  for cost in costs.values():
    assert cost.programs == b * h * d // tiles["value_block"]
    assert cost.work.steps == t // tiles["chunk"]
    assert cost.work.fma_flops > 0 and cost.work.tensor_flops == 0  # float32 at HIGHEST: FMAs


@pytest.mark.skipif(not topologies.cuda_plugin_installed(), reason="the CUDA plugin is not installed")
def test_the_roofline_charges_a_triton_call_by_its_grid_when_given_one():
  """The compiled H100 program of causal Latte's forward: with its grid costs the roofline charges the Triton
  call `gpu_seconds` of its grid; without them, what the kernel declares at the chip's peak."""
  x, v = jax.ShapeDtypeStruct((1, 512, 2, 16), jnp.float32), jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.float32)
  fn = lambda q, k, v: latte.causal_latte(q, k, v, impl="pallas")
  devices = topologies.gpu_devices("h100")
  compiled, _, _ = gpu_compile.compile_for_gpu(fn, (x, x, v), devices, inspect=False)
  jaxpr = gpu_compile.traced_for_gpu(fn, (x, x, v), devices).jaxpr
  declared, (grid,) = pallas_costs.pallas_kernel_costs(jaxpr), pallas_grid.grid_costs(jaxpr)
  chip = chips.CHIPS[H100.kind]
  by_grid = hlo_cost.roofline(compiled.as_text(), chip, top=50, kernel_costs=declared, grid_costs=(grid,), gpu=H100)
  plain = hlo_cost.roofline(compiled.as_text(), chip, top=50, kernel_costs=declared)
  kernel = lambda r: [h for h in r.hotspots if h.category == "kernels"]
  want = pallas_grid.gpu_seconds(grid, H100, tensor_flops_per_s=chip.peak_flops, hbm_bandwidth=chip.hbm_bandwidth)
  (call,) = kernel(by_grid)
  assert call.seconds == pytest.approx(want)
  (call,) = kernel(plain)
  assert call.seconds == pytest.approx(
    max(declared[0].flops / chip.peak_flops, declared[0].bytes_accessed / chip.hbm_bandwidth)
  )
  assert by_grid.seconds > plain.seconds  # 2 x 2 x 2 programs walking 32 blocks: far from the chip's peak


def test_an_sm_holds_as_many_programs_as_its_threads_registers_and_shared_memory_allow():
  """with_occupancy: the scarcest of the SM's 2,048 threads, 65,536 registers, 228 KiB of shared memory and
  32 blocks; waves of that many programs per SM, each wave their work one after another plus the latency of
  its serial steps once."""
  work = pallas_grid.Work(fma_flops=1e6, steps=10)
  cost = pallas_grid.GridCost("k", (), (8 * H100.sms,), work, block_bytes=1e5)
  occupied = lambda **kw: pallas_grid.with_occupancy(cost, H100, **kw).resident
  assert occupied(threads=256, registers=169, shared_bytes=6 * 1024) == 1  # 169 x 256 registers: one block
  assert occupied(threads=128, registers=64, shared_bytes=0) == 8  # registers: 65,536 / (64 x 128)
  assert occupied(threads=128, registers=32, shared_bytes=0) == 16  # threads: 2,048 / 128
  assert occupied(threads=128, registers=32, shared_bytes=100 * 1024) == 2  # shared memory: 228 / 100 KiB
  assert occupied(threads=128, registers=None, shared_bytes=0) == 1  # registers unknown (no ptxas)
  seconds = functools.partial(pallas_grid.gpu_seconds, gpu=H100, tensor_flops_per_s=989e12, hbm_bandwidth=3.35e12)
  one = seconds(cost)  # 8 waves of one
  held = pallas_grid.with_occupancy(cost, H100, threads=128, registers=64, shared_bytes=0)  # 1 wave of 8
  program = one / 8 - 10 * pallas_grid.MEMORY_LATENCY_S
  assert seconds(held) == pytest.approx(8 * program + 10 * pallas_grid.MEMORY_LATENCY_S)
