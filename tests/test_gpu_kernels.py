"""The kernels compiled for an NVIDIA H100 on this CPU host (no GPU, no driver): under `jax.set_mesh` of the
H100 devices of lra_core.compilation.topologies.gpu_devices every kernel's forward and training gradient lower to
a Pallas Triton call, and XLA:GPU, Triton (its shared-memory allocation included) and ptxas compile them; the VQ and
FLASH kernels also at their papers' sizes, where they once exceeded the H100's shared memory.
scripts/check_lowering.py --platforms=gpu runs the same compiles with a table of the kernels' resources."""

import jax
import pytest

import tiers
from lra_core.bench import gpu_compile
from lra_core.compilation import topologies
from lra_core.cost import chips
from lra_core.errors import ConfigError
from lra_core.kernels import catalog, latte, toolkit

needs_plugin = pytest.mark.skipif(
  not topologies.cuda_plugin_installed(),
  reason="the CUDA plugin is not installed (pip install -e \".[test]\" brings it)",
)
SIZES = dict(seq_len=256, width=64, latents=32, block=128, codes=128, chunk=0, flash_chunk=128)
KERNELS = tuple(catalog.kernels_at(**SIZES))
NAMES = {
  "vq_attention": {"vq_attention", "vq_attention_dq", "vq_attention_dk", "vq_attention_dv"},
  "causal_latte": {"causal_latte", "causal_latte_backward_dp", "causal_latte_backward"},
  "mixed_chunk": {"mixed_chunk_attention", "mixed_chunk_dq", "mixed_chunk_dk", "mixed_chunk_dv"},
  "bidirectional_latte": {"bidirectional_latte", "bidirectional_latte_documents", "bidirectional_latte_backward"},
}


@pytest.fixture(scope="module")
def h100():
  return topologies.gpu_devices("h100")


def _compile_both_passes(fn, args, devices):
  """Forward and training gradient compiled; each program must hold the kernel as a Triton call."""
  found = []
  for f in (fn, catalog.gradient(fn)):
    compiled, _, kernels = gpu_compile.compile_for_gpu(f, args, devices)
    assert gpu_compile.TRITON_TARGET in compiled.as_text()  # the Pallas kernel, not interpret mode or XLA
    assert kernels and all(k.threads > 0 and k.grid != (0, 0, 0) for k in kernels)
    found += kernels
  return found


@needs_plugin
@pytest.mark.parametrize(
  "name,segments",
  tiers.quick(
    [(n, d) for n in KERNELS for d in (False, True)], keep=[3, 7], ids=lambda c: f"{c[0]}{'-documents' if c[1] else ''}"
  ),
)
def test_forward_and_gradient_compile_for_an_h100(h100, name, segments):
  fn, args = catalog.kernels_at(**SIZES, dtype="float32", segments=segments)[name]
  kernels = _compile_both_passes(fn, args, h100)
  assert {k.name for k in kernels} <= NAMES[name]
  assert all(k.shared_bytes <= topologies.GPUS["h100"].shared_per_block for k in kernels)


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("paper", ["enwik8_vq", "c4_flash"])
def test_vq_and_flash_compile_at_the_papers_sizes_without_spills(h100, paper, dtype):
  """Transformer-VQ's enwik8 head (block 512, 512 codes, Dk 128, Dv 1536, XL biases) and FLASH's C4 GAU
  (chunk 256, s 128, e 1536): both exceeded the H100's 227 KiB of shared memory per block before the GPU's
  parallel driver; now they compile, forward and gradient, and ptxas spills nothing."""
  name, widths = catalog.PAPER[paper]
  fn, args = catalog.kernels_at(**dict(SIZES, seq_len=2048, **widths), dtype=dtype)[name]
  for k in _compile_both_passes(fn, args, h100):
    assert k.shared_bytes <= topologies.GPUS["h100"].shared_per_block, k.describe()
    if k.spill_stores is not None:  # ptxas found
      assert k.spill_stores == 0, k.describe()


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("segments", [False, True], ids=["", "documents"])
@pytest.mark.parametrize("paper", ["c4_latte", "lra_text_latte"])
def test_latte_compiles_at_the_papers_sizes_without_spills(h100, paper, segments):
  """Latte's C4 heads (causal, 16 latents, values 96 wide) and LRA text heads (bidirectional, 64 latents and
  values): the float32 matmuls contract a time block or a latent group, so ptxas spills nothing (whole
  blocks once spilled up to 98 KB per thread)."""
  name, widths = catalog.PAPER[paper]
  fn, args = catalog.kernels_at(**dict(SIZES, seq_len=2048, **widths), dtype="float32", segments=segments)[name]
  for k in _compile_both_passes(fn, args, h100):
    if k.spill_stores is not None:
      assert k.spill_stores == 0, k.describe()


@needs_plugin
@pytest.mark.parametrize("t", [10, 200])
def test_bidirectional_latte_s_backward_compiles_off_the_blocks(h100, t):
  """Triton takes only powers of two: the backward kernel's time block stays one (16) past the end of a
  10-step sequence and off the end of a 200-step one, its rows beyond the end masked."""
  x = jax.ShapeDtypeStruct((2, t, 4, 64), jax.numpy.float32)
  fn = lambda q, k, v: latte.bidirectional_latte(q, k, v, impl="pallas")
  kernels = _compile_both_passes(fn, (x, x, x), h100)
  assert "bidirectional_latte_backward" in {k.name for k in kernels}


@needs_plugin
def test_the_kernels_follow_the_gpu_mesh(h100):
  """The target comes from the mesh: GPU devices give Triton (no interpret mode), the kernels' GPU drivers
  and the GPU tiles, on a host whose only backend is the CPU."""
  mesh = gpu_compile.gpu_mesh(h100)
  with jax.set_mesh(mesh):
    assert toolkit.platform() == "gpu" and not toolkit.interpret_default()
    assert toolkit.driver(gpu="parallel", drivers=("grid", "parallel")) == "parallel"
    params = toolkit.compiler_params(2, sequential=False, kernel="vq_attention")
    assert params.num_warps == toolkit.GPU_TILES["vq_attention"]["num_warps"]
  assert jax.default_backend() == "cpu" and toolkit.platform() == "cpu"


def test_gpu_targets_are_named_and_described():
  arch, count = topologies.parse_gpu_topology("a100x4")
  assert (arch.kind, count) == ("NVIDIA A100-SXM4-80GB", 4)
  assert topologies.parse_gpu_topology("h100x16")[1] == 16 and topologies.is_gpu_topology("h100x8")
  assert not topologies.is_gpu_topology("v3:2x2") and not topologies.is_gpu_topology("tpu")
  text = topologies.GPUS["h100"].target_config()
  assert "major: 9 minor: 0" in text and "shared_memory_per_block_optin: 232448" in text
  for arch in topologies.GPUS.values():
    assert arch.kind in chips.CHIPS and f'name: "{arch.kind}"' in arch.target_config()
  with pytest.raises(ConfigError, match="GPU target 'b200' is not known"):
    topologies.parse_gpu_topology("b200")
  with pytest.raises(ConfigError, match="has 12 GPUs; expected 1 to 8 on one host or a multiple of 8"):
    topologies.parse_gpu_topology("h100x12")


def test_a_missing_cuda_plugin_is_one_sentence_naming_the_extra(monkeypatch):
  monkeypatch.setattr(topologies, "cuda_plugin_installed", lambda: False)
  with pytest.raises(ConfigError, match=r'pip install -e "\.\[gpu-compile\]"'):
    topologies.gpu_devices("h100")


@needs_plugin
def test_several_gpus_and_hosts_are_compile_only_devices():
  devices = topologies.gpu_devices("h100x16")
  assert len(devices) == 16 and {d.process_index for d in devices} == {0, 1}
  assert {d.device_kind for d in topologies.gpu_devices("a100-40gx2")} == {"NVIDIA A100-SXM4-40GB"}
