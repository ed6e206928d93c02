"""What a step costs: chip facts (chips), a compiled program's HLO read into operations (hlo_text),
its matrix-product FLOPs (hlo_flops) and roofline step time (hlo_cost), the Pallas calls' declared
costs (pallas_costs), and a run's measured tokens/s and MFU (throughput). Below the run, which
reports with it; above the runtime.
"""
