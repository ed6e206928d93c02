"""The model protocol: what a model family gives the framework, written down once.

A family is one module in models/ that defines an `nnx.Module` class and a `FAMILY = Family(...)`
record. The framework (trainer, tasks, decoding, sharding, counts, the cross-family tests) reads the
record and calls the methods the record's capabilities promise; it never probes a model for
attributes. docs/api.md describes the protocol in prose.

Every model:

  Model(m, run, *, rngs)            built from its section m = config.model and run = RunInfo.of(config),
                                    the few facts of the run it needs (task, training length)
  model(inputs, *, mask=None, rngs=None) -> logits, or (logits, aux) with aux a dict of extra losses

Capabilities add methods (see the Protocol classes below):

  decode      init_decode_state(batch_size, max_len) and decode_step(tokens[B,1], state), built for a
              causal task (lm / image_ar): model(tokens)[:, t] predicts token t + 1
  prefill     can_prefill (bool) and prefill(tokens[B,P], state): a whole prompt in one pass
  carry       init_carry(batch_size) and model(inputs, carry=...) -> ((logits, carry), aux): state
              carried from one update window of a long sequence to the next
  uptrain     the record's uptrain_params maps another model's parameters onto this one's
  self_condition  a denoiser fed its previous latents (task diffusion; see Denoiser)
  block_losses    the lm loss is also reported by position inside blocks of config.model.block_len
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax

from lra_core import diffusion, task_kinds

Array = jax.Array
ConfigDict = Any  # an ml_collections.ConfigDict


class Model(Protocol):
  """What every family's Model class is: built from its own section and the run's facts."""

  def __init__(self, m: ConfigDict, run: RunInfo, *, rngs: Any) -> None: ...

  def __call__(self, inputs: Array, *, mask: Array | None = None, rngs: Any = None) -> Any: ...


@runtime_checkable
class Decoder(Protocol):
  """Capability `decode`: token-by-token generation with a cache (lra_core.decoding.generate)."""

  def init_decode_state(self, batch_size: int, max_len: int) -> Any: ...

  def decode_step(self, tokens: Array, state: Any) -> tuple[Array, Any]: ...


@runtime_checkable
class Prefiller(Decoder, Protocol):
  """Capability `prefill`: a prompt in one pass; `can_prefill` says whether this instance can."""

  can_prefill: bool

  def prefill(self, tokens: Array, state: Any) -> tuple[Array, Any]: ...


@runtime_checkable
class CarryModel(Protocol):
  """Capability `carry`: a state the trainer keeps across the update windows of a sequence."""

  def init_carry(self, batch_size: int) -> Any: ...


@runtime_checkable
class Denoiser(Protocol):
  """Task `diffusion`: model(x_t, gamma, labels=, latents_prev=) -> (prediction, latents)."""

  self_condition: bool

  def latents_shape(self, batch_size: int) -> tuple[int, ...]: ...

  def __call__(
    self, x_t: Array, gamma: Array, *, labels: Array | None = None, latents_prev: Array | None = None, rngs: Any = None
  ) -> tuple[Array, Array]: ...


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """Which optional parts of the protocol a family implements (module docstring)."""

  decode: bool = False
  prefill: bool = False
  carry: bool = False
  uptrain: bool = False
  self_condition: bool = False
  block_losses: bool = False


@dataclasses.dataclass(frozen=True)
class Smoke:
  """A small config of the family that the cross-family tests run without being edited: kill and
  resume, the config property test, sharding layouts, remat/scan and (with `decode`) the causal and
  decoding oracles."""

  config: str  # a `tiny` config spec, seconds per step on a CPU
  data: str  # the dataset it reads; the tests build it as a fixture
  overrides: tuple[str, ...] = ()  # settings that keep it small and reach its code paths
  light: tuple[str, ...] = ()  # cuts (fewer layers) for tests of state and shapes only:
  # kill/resume and the property test
  fuzz: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
  """family-specific config keys -> candidate values (valid and invalid) for the property test"""
  causal: str = ""  # with `decode`: a causal tiny spec for the decode oracles


@dataclasses.dataclass(frozen=True)
class PaperRow:
  """One parameter count a paper prints, and the config that builds that model."""

  config: str  # config spec at the paper's size
  count: float  # the paper's number
  source: str  # e.g. "Transformer-VQ Table 10, Enwik8"
  tolerance: float = 0.05  # relative gap allowed: the papers round their counts
  counts: str = "total"  # "total" or "non_embedding" (what the paper counts)
  gap_reason: str = ""  # why a count outside the tolerance is kept as printed


def no_checks(config: ConfigDict) -> None:
  """The default validate_config: the shared checks of lra_core.config are all a family needs."""


def always(config: ConfigDict) -> bool:
  return True


@dataclasses.dataclass(frozen=True)
class RunInfo:
  """What a model needs to know of its run besides its own `config.model` section."""

  task: str  # the objective (config.task): causal or not, which output head
  seq_len: int  # the training length (config.train.seq_len): position tables where model.max_len is 0
  # Classifier-free guidance: the label of the null class, a class-conditional denoiser's extra label row
  # (lra_core.diffusion.null_label); None without guidance.
  null_label: int | None = None

  @property
  def kind(self) -> task_kinds.TaskKind:
    """The task's properties (causal, classifies, image, per_token, labelled, towers)."""
    return task_kinds.kind(self.task)

  @classmethod
  def of(cls, config: ConfigDict) -> RunInfo:
    null = diffusion.null_label(config) if "diffusion" in config else None
    return cls(task=config.task, seq_len=config.train.seq_len, null_label=null)


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family's record: how the framework builds, checks, counts and tests it."""

  name: str  # config.model.name, the module's name in models/
  model: Callable[..., Any]  # the Model class: model(config.model, RunInfo.of(config), rngs=rngs)
  tasks: tuple[str, ...]  # config.task values it is built for
  smoke: Smoke
  capabilities: Capabilities = Capabilities()
  validate_config: Callable[[ConfigDict], None] = no_checks
  """raises ConfigError (one sentence) for settings the model cannot build, before any compile"""
  uptrain_params: Callable[[dict, dict, ConfigDict], dict] | None = None
  """(params, source params, config) -> params: with capability `uptrain` (train.init_from)"""
  uptrain_source: Callable[[ConfigDict], ConfigDict] | None = None
  """config -> the config.model of the transformer it uptrains from: with `uptrain`, what a Hugging Face
  folder's model is checked against and read as (train.init_from=hf:, lra_core/hf)"""
  embedding_params: tuple[str, ...] = ("embed", "positions", "head")
  """top-level attributes that map tokens in and out (not counted in non-embedding sizes)"""
  counted_state: tuple[type, ...] = ()  # non-Param variables counted beside the parameters
  paper_rows: tuple[PaperRow, ...] = ()
  generate: Callable[..., Array] | None = None
  """the family's own sampling loop, (model, prompt, *, max_new_tokens, key, temperature, top_k, top_p,
  eos_id) -> new tokens int32[B,N] (Block Transformer); None: lra_core.decoding.generate serves it"""
  carry_if: Callable[[ConfigDict], bool] = always
  """with capability `carry`: whether the model `config` builds carries state (e.g. not with full
  attention)"""
  context_parallel: Callable[[ConfigDict, int], None] | None = None
  """raises ConfigError (one sentence) for settings that cannot split each sequence's time axis over
  n chips (mesh.sequence = n > 1; kernels/context_parallel.py); None: the family cannot split one at all yet"""
  cannot_split: str = "it is not built for it yet"
  """without context_parallel: why the family cannot split a sequence, the clause of its refusal"""
  upgrades: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  """model keys added after runs were saved -> the value that builds, from a config saved before the
  key existed, the model that config built then (often not today's default);
  lra_core.checkpoints.saved_config.upgrade_config adds each absent one, so the model reads every key of its
  section directly"""

  def keeps_carry(self, config: ConfigDict) -> bool:
    """Whether the trainer keeps a carry (init_carry) between the update windows of `config`."""
    return self.capabilities.carry and self.carry_if(config)

  def __post_init__(self):
    if self.capabilities.uptrain != (self.uptrain_params is not None):
      raise ValueError(f"family {self.name!r}: capability uptrain and uptrain_params go together.")
    if self.capabilities.decode and not self.smoke.causal:
      raise ValueError(f"family {self.name!r} declares decode; its smoke record needs a causal spec.")
