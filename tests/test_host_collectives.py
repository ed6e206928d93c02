"""XLA:CPU's collectives over host devices wait as long as a loaded host needs (tests/conftest.py).

Every host device of a CPU program is a thread of one process, and a collective waits in a
rendezvous until all of them arrive: XLA:CPU warns on stderr when one is 20 s late and ends the
process with SIGABRT 40 s after that (unless set), which a loaded 2-core host once reached at the
end of an 8-device run whose steps had all finished. Oracle: one device made late on purpose (a
host callback that sleeps before the all-reduce), in a process of its own: with both timeouts set
below the delay the process aborts in the rendezvous, so these flags are the knob; with the suite's
flags (names XLA would refuse at start-up if it did not know them) it returns the all-reduce's sum.
"""

import os
import subprocess
import sys

from conftest import HOST_COLLECTIVES

LATE_S = 3
PROGRAM = f"""
import time
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((4,), ("x",))

def arrive(index):
  if int(index) == 0:
    time.sleep({LATE_S})  # device 0 reaches the all-reduce this late
  return index

def body(x):
  i = jax.pure_callback(arrive, jax.ShapeDtypeStruct((), jnp.int32), jax.lax.axis_index("x"))
  return jax.lax.psum(x + i.astype(x.dtype), "x")

x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
print(float(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))(x)[0]))
"""


def _run(xla_flags: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {xla_flags}")
  return subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)


def test_a_device_late_to_a_collective_aborts_below_the_timeout_and_is_waited_for_with_the_suite_s():
  # The rendezvous warns after the first timeout, then aborts after the second: 1 + 1 s < LATE_S.
  short = _run(
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1 --xla_cpu_collective_call_terminate_timeout_seconds=1"
  )
  assert short.returncode == -6 and "Termination timeout" in short.stderr, (short.returncode, short.stderr[-2000:])
  assert HOST_COLLECTIVES in os.environ["XLA_FLAGS"], "XLA_FLAGS was set outside the suite: the suite's flags are off"
  waited = _run(HOST_COLLECTIVES)
  assert waited.returncode == 0, waited.stderr[-2000:]
  assert waited.stdout.split() == [str(float(2 * sum(range(4))))]  # each device adds its x (its index) and index
  assert "rendezvous" not in waited.stderr, waited.stderr[-2000:]  # nor warned about as stuck
