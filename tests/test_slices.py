"""Meshes over several slices (mesh.slices, lra_core/layout.py) and what they cost between slices.

Compile-only TPU devices of 2 slices (libtpu's topology, `slice_index` 0 and 1) stand for a
multi-slice job; the collectives between slices are checked against an independent count of the
compiled program's data-center-network transfers. Two CPU processes, each one slice, train like one
process in tests/test_multiprocess.py."""

import re

import jax
import pytest

import lra_core
from lra_core import layout
from lra_core.aot import compile_config
from lra_core.compilation import topologies
from lra_core.compilation.aot_report import Report
from lra_core.cost import chips, hlo_cost
from lra_core.errors import ConfigError

needs_libtpu = pytest.mark.skipif(not topologies.libtpu_installed(), reason="libtpu is not installed")
TINY = "configs/c4/transformer.py:tiny"


def mesh_config(**sizes):
  config = lra_core.load_config(
    TINY, [f"mesh.{k}={v!r}" if isinstance(v, str) else f"mesh.{k}={v}" for k, v in sizes.items()]
  )
  return config.mesh


@pytest.fixture(scope="module")
def two_slices():
  return topologies.tpu_devices("v5e:2x2", slices=2)


@needs_libtpu
@pytest.mark.parametrize(
  "axis, sizes", [("data", dict(data=-1)), ("fsdp", dict(data=1, fsdp=-1)), ("data", dict(data=4, tensor=2))]
)
def test_the_slice_axis_spans_the_slices_outermost_and_the_others_stay_inside_one(two_slices, axis, sizes):
  mesh = layout.make_mesh(mesh_config(slices=2, slice_axis=axis, **sizes), two_slices)
  along = list(mesh.axis_names).index(axis)
  for position in range(mesh.shape[axis]):
    block = mesh.devices.take(position, axis=along)
    # The first half of the slice axis is slice 0's, the second slice 1's; every other axis one slice.
    assert {d.slice_index for d in block.flat} == {position // (mesh.shape[axis] // 2)}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in two_slices)


@needs_libtpu
@pytest.mark.parametrize(
  "sizes, message",
  [
    (dict(slices=3, data=-1), r"^mesh.slices=3, but the 8 devices are in 2 slices.$"),
    (dict(slices=2, data=1, fsdp=-1), r"^mesh.data 1 does not split over mesh.slices=2 \(mesh.slice_axis='data'\)"),
    (dict(slices=2, data=2, fsdp=2), r"^mesh \{.*\} uses 4 of 8 devices; a mesh over slices must use all of them"),
  ],
)
def test_a_mesh_the_slices_do_not_divide_is_one_sentence(two_slices, sizes, message):
  with pytest.raises(ConfigError, match=message):
    layout.make_mesh(mesh_config(**sizes), two_slices)


def test_on_cpu_each_process_is_a_slice_and_one_process_is_one_slice():
  with pytest.raises(
    ConfigError, match=r"^mesh.slices=2, but the 8 devices are in 1 processes \(one slice each here\).$"
  ):
    layout.make_mesh(mesh_config(slices=2, data=-1), jax.devices())
  assert layout.make_mesh(mesh_config(slices=1, data=-1), jax.devices()).shape["data"] == len(jax.devices())


@pytest.mark.parametrize(
  "override, message",
  [
    ("mesh.slices=0", r"mesh.slices must be a positive integer, got 0"),
    ("mesh.slice_axis='tensor'", r"mesh.slice_axis must be one of \['data', 'fsdp'\], got 'tensor'"),
  ],
)
def test_slice_settings_are_checked_with_the_config(override, message):
  with pytest.raises(ConfigError, match=message):
    lra_core.load_config(TINY, [override])


def _send_bytes(hlo: str) -> int:
  """The data of every transfer between slices, counted from the HLO text apart from hlo_cost's walk."""
  total = 0
  for m in re.finditer(
    r"= \((\w+)\[([\d,]*)\]\{[^}]*\}, u32\[\], token\[\]\) send\(.*_xla_megascale_transfer_type", hlo
  ):
    n = 1
    for d in filter(None, m.group(2).split(",")):
      n *= int(d)
    total += {"f32": 4, "bf16": 2, "s32": 4, "u32": 4}[m.group(1)] * n
  return total


@needs_libtpu
def test_aot_over_two_slices_charges_the_transfers_between_them_at_dcn_speed(tmp_path):
  """The compiled step keeps each collective inside a slice and sends the rest between slices as
  host transfers: their bytes (an all-reduce over 2 slices sends its buffer once) go at v5e's 25 Gbps
  a chip, and the report names the slices."""
  config = lra_core.load_config(TINY, [])
  hlo = tmp_path / "step.hlo"
  report = compile_config(config, "v5e:2x2", slices=2, hlo_path=hlo)
  assert report.slices == 2 and report.mesh["data"] == 8 and report.num_devices == 8
  sent = _send_bytes(hlo.read_text())
  assert sent > 4 * report.num_params  # the gradients cross (in tile-padded buffers)
  assert report.dcn_comm_bytes == sent
  assert report.dcn_comm_seconds == pytest.approx(sent / (25e9 / 8))
  assert "2 slices of v5e:2x2 over the data-center network" in report.table()
  assert "between the 2 slices (DCN, the data axis)" in report.comm_text()
  assert Report.from_json(report.to_json()) == report


@needs_libtpu
def test_slices_are_refused_where_no_dcn_bandwidth_is_published_and_on_gpus():
  config = lra_core.load_config(TINY, [])
  with pytest.raises(ConfigError, match=r"^TPU v4 has no published data-center network bandwidth"):
    compile_config(config, "v4:2x2x1", slices=2)
  with pytest.raises(ConfigError, match=r"^--slices applies to TPU slices, not to GPUs"):
    compile_config(config, "h100", slices=2)
  with pytest.raises(ConfigError, match=r"^--slices=2 contradicts the config's mesh.slices=4"):
    compile_config(lra_core.load_config(TINY, ["mesh.slices=4"]), "v5e:2x2", slices=2)


def test_a_collective_across_process_slices_goes_at_dcn_speed_and_one_inside_at_ici_speed():
  """Where the collectives themselves span slices (processes as slices on CPU and GPU meshes), their
  replica groups say so: data 2 over the slices x fsdp 2 inside, devices in mesh order."""
  hlo = """
HloModule m

ENTRY %main (p: f32[1024]) -> (f32[1024], f32[1024]) {
  %p = f32[1024]{0} parameter(0)
  %across = f32[1024]{0} all-reduce(%p), replica_groups={{0,2},{1,3}}, to_apply=%add
  %inside = f32[1024]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %t = (f32[1024]{0}, f32[1024]{0}) tuple(%across, %inside)
}
"""
  chip = chips.CHIPS["TPU v5 lite"]
  mesh = (("data", 2), ("fsdp", 2), ("sequence", 1), ("tensor", 1))
  roof = hlo_cost.roofline(hlo, chip, mesh=mesh, slices=("data", 2))
  moved = 2 * 1024 * 4  # an all-reduce counts twice its buffer
  assert roof.dcn_comm_bytes == moved and roof.comm_bytes == 2 * moved
  assert roof.dcn_comm_s == pytest.approx(moved / chip.dcn_bandwidth)
  assert roof.comm_s == pytest.approx(moved / chip.dcn_bandwidth + moved / chip.ici_bandwidth)
  assert hlo_cost.roofline(hlo, chip, mesh=mesh).dcn_comm_bytes == 0  # one slice: nothing between slices
