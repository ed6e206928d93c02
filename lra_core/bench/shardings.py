r"""How a config's parameters are split over a mesh, computed without devices.

  python scripts/shardings.py --config=configs/c4/latte.py --devices=256 \
      --config.mesh.data=16 --config.mesh.fsdp=-1 --config.mesh.tensor=4
  python scripts/shardings.py --families --devices=8 --config.mesh.data=2 \
      --config.mesh.fsdp=2 --config.mesh.tensor=2      # every model family's tiny config
  python scripts/shardings.py --families --paper --devices=64 --config.mesh.data=8 \
      --config.mesh.fsdp=4 --config.mesh.tensor=2      # the paper sizes (docs/launching.md)

The same command as `python -m lra_core.bench.shardings`.

Prints each parameter's logical axes and PartitionSpec (with --params), and a summary: the
share of parameters split over `fsdp` and over `tensor`, and the parameter bytes (float32) one
device holds. The mesh axes come from `config.mesh` (-1 = the remaining devices of --devices),
the logical-to-mesh mapping from `config.sharding.rules`; both can be overridden as usual.
`parameter_layout` computes the rows (an abstract mesh and abstract parameters, no device).
"""

from __future__ import annotations

import math
import sys

from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from lra_core import cli, registry
from lra_core.config import load_config
from lra_core.layout import mesh_axes_used, mesh_shape
from lra_core.sharding import MESH_AXES, logical_to_spec

# Each family's smoke config, a `tiny` one (the families' paper configs share their layouts).
FAMILIES = {family.name: family.smoke.config for family in registry.families()}


def paper_spec(spec: str) -> str:
  """The paper-size config of a `tiny` spec: the same file and args without `tiny`."""
  path, _, arg = spec.partition(":")
  args = [a for a in arg.split(",") if a and a != "tiny"]
  return f"{path}:{','.join(args)}" if args else path


def parameter_layout(config, num_devices: int) -> list[dict]:
  """How `config`'s parameters would be split on `num_devices` devices, without any device.

  One row per parameter: path, shape, logical axes, PartitionSpec and the elements each device
  holds. Uses an abstract mesh and abstract parameters, so it runs anywhere in a second
  (scripts/shardings.py prints it; docs/launching.md tabulates it per model family).
  """
  sizes = mesh_shape(config.mesh, num_devices)
  mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
  model = nnx.eval_shape(lambda: registry.build_model(config, seed=0))
  rows = []
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    shape = tuple(var.get_value().shape)
    axes = var.get_metadata().get("logical_axes")
    spec = P() if axes is None else logical_to_spec(axes, config.sharding.rules, mesh, shape)
    split = math.prod(mesh.shape[a] for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry))
    rows.append(
      dict(
        path="/".join(map(str, path)),
        shape=shape,
        logical_axes=axes,
        spec=spec,
        size=math.prod(shape),
        per_device=math.prod(shape) // split,
      )
    )
  return rows


def summarize(rows: list[dict]) -> dict:
  total = sum(r["size"] for r in rows)
  share = {
    axis: sum(r["size"] for r in rows if axis in mesh_axes_used(r["spec"])) / total for axis in ("fsdp", "tensor")
  }
  names = sorted({a for r in rows for a in (r["logical_axes"] or ()) if a})
  return dict(
    params=total,
    fsdp=share["fsdp"],
    tensor=share["tensor"],
    logical_axes=names,
    per_device_mib=4 * sum(r["per_device"] for r in rows) / 2**20,
  )


def main(argv=None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  overrides = [a[len("--config.") :] for a in argv if a.startswith("--config.")]
  parser = cli.doc_parser("python scripts/shardings.py", __doc__)
  parser.add_argument(
    "--config", help="a config spec (file[:arg]); --config.KEY=VALUE overrides one field (e.g. --config.mesh.fsdp=4)"
  )
  parser.add_argument("--families", action="store_true", help="one row per model family (tiny configs)")
  parser.add_argument("--paper", action="store_true", help="with --families: the paper-size configs")
  parser.add_argument("--devices", type=int, default=8, help="devices of the mesh to lay out")
  parser.add_argument("--params", action="store_true", help="also list every parameter")
  ns = parser.parse_args([a for a in argv if not a.startswith("--config.")])
  if not ns.families and not ns.config:
    parser.error("give --config=<spec> or --families")
  specs = dict(FAMILIES) if ns.families else {ns.config: ns.config}
  if ns.paper:
    specs = {name: paper_spec(spec) for name, spec in specs.items()}
  print(
    "| model | config | mesh | parameters | split over fsdp | split over tensor | MiB per device (f32) | logical axes |"
  )
  print("|---|---|---|---:|---:|---:|---:|---|")
  layouts = {}
  for name, spec in specs.items():
    config = load_config(spec, overrides)
    rows = layouts[name] = parameter_layout(config, ns.devices)
    s = summarize(rows)
    mesh = " x ".join(f"{a} {n}" for a, n in mesh_shape(config.mesh, ns.devices).items())
    print(
      f"| {name} | `{spec}` | {mesh} | {s['params']:,} | {s['fsdp']:.0%} | {s['tensor']:.0%} | "
      f"{s['per_device_mib']:.3f} | {', '.join(s['logical_axes'])} |"
    )
  if ns.params:
    for name, rows in layouts.items():
      print(f"\n{name}:\n\n| parameter | shape | logical axes | PartitionSpec |\n|---|---|---|---|")
      for r in rows:
        print(f"| {r['path']} | {r['shape']} | {r['logical_axes']} | {tuple(r['spec'])} |")


if __name__ == "__main__":
  cli.run(main)
