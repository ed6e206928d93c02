"""The roofline's estimate of every Pallas kernel and its XLA form on a GPU, compiled on this host (no GPU):
the rows of `scripts/run_kernels.py` (lra_core/bench/kernel_run.py), estimated instead of run, each Pallas
call charged two ways: by what it declares (`CostEstimate`, lra_core/cost/pallas_costs.py) and by its grid
(lra_core/cost/pallas_grid.py: waves of programs on the SMs, a memory latency per serial step).

  python scripts/run_kernels.py --estimate=h100 --paper=all --seq_len=8192 --batch=1

docs/kernels.md puts these beside the times the same rows measured on an H100.
"""

from __future__ import annotations

from lra_core.bench import gpu_compile
from lra_core.compilation import topologies
from lra_core.cost import chips, hlo_cost, pallas_costs, pallas_grid
from lra_core.kernels.catalog import gradient, kernels_at
from lra_core.markdown import markdown_table

# the GPUs `estimate` compiles for, by name: Pallas lowers to Triton from compute capability 8.0 (no V100)
GPUS = {name: arch for name, arch in topologies.GPUS.items() if arch.compute_capability >= (8, 0)}
COLUMNS = (
  "kernel",
  "sizes",
  "dtype",
  "forward est. ms: XLA / Pallas declared / Pallas grid",
  "forward + grad est. ms: XLA / Pallas declared / Pallas grid",
  "Pallas calls: programs x serial steps",
)


def estimate(sizes: dict, *, only: tuple[str, ...] = (), gpu: str = "h100") -> list[dict]:
  """One row per kernel (those in `only`, or all) at `sizes` (kernels_at's arguments), compiled for one `gpu`."""
  arch = topologies.GPUS[gpu]
  devices = topologies.gpu_devices(gpu)
  chip = chips.CHIPS[arch.kind]
  rows = []
  for name in kernels_at(**sizes, impl="xla"):
    if only and name not in only:
      continue
    row = dict(kernel=name, **{k: v for k, v in sizes.items() if k != "segments"}, device=arch.kind)
    for impl in ("xla", "pallas"):
      fn, args = kernels_at(**sizes, impl=impl)[name]
      for what, f in (("forward", fn), ("step", gradient(fn))):
        compiled, _, kernels = gpu_compile.compile_for_gpu(f, args, devices)
        jaxpr = gpu_compile.traced_for_gpu(f, args, devices).jaxpr
        declared, grids = pallas_costs.pallas_kernel_costs(jaxpr), pallas_grid.grid_costs(jaxpr)
        # the programs an SM holds at once, from the compiled kernels (ptxas' registers, Triton's threads and
        # shared memory)
        built = {k.name: k for k in kernels}
        grids = tuple(
          pallas_grid.with_occupancy(
            g,
            arch,
            threads=built[g.name].threads,
            registers=built[g.name].registers,
            shared_bytes=built[g.name].shared_bytes,
          )
          if g.name in built
          else g
          for g in grids
        )
        hlo = compiled.as_text()
        row[f"{what}_ms_{impl}"] = 1e3 * hlo_cost.roofline(hlo, chip, kernel_costs=declared).seconds
        if impl == "pallas":
          grid = hlo_cost.roofline(hlo, chip, kernel_costs=declared, grid_costs=grids, gpu=arch).seconds
          row[f"{what}_ms_grid"] = 1e3 * grid
          row.setdefault("calls", {}).update({g.name: (g.programs, int(g.work.steps), g.resident) for g in grids})
    rows.append(row)
  return rows


def table(rows) -> str:
  def cells(r):
    sizes = f"B {r['batch']} T {r['seq_len']} H {r['heads']} d {r['width']}" + (
      f" dv {r['value_width']}" if r.get("value_width") else ""
    )
    three = lambda what: " / ".join(f"{r[f'{what}_ms_{x}']:.3f}" for x in ("xla", "pallas", "grid"))
    calls = ", ".join(f"{n} {p:,} x {s} ({k} per SM at once)" for n, (p, s, k) in r["calls"].items())
    return (r["kernel"], sizes, r["dtype"], three("forward"), three("step"), calls)

  return markdown_table(COLUMNS, [cells(r) for r in rows])
