"""Passkey retrieval: a number hidden at a chosen depth of filler text, which a causal model must
give back when the prompt ends with "The pass key is".

A prompt of P tokens is filler sentences repeated ("The grass is green. The sky is blue. ..."), with
"The pass key is NNNNN. Remember it." put in at the sentence boundary nearest to depth d of the filler
(d in [0, 1]: 0 its start, 1 its end, just before the question), then "What is the pass key? The pass
key is". Each piece is encoded on its own with the run's text codec (bytes for the byte-level configs)
and the ids are joined, so a prompt has exactly the length asked for at any tokenizer. The model
continues it greedily for `answer_tokens(digits)` tokens, so prompt and answer fill `length`
positions; an answer is right when the first number it reads is the key (`score`), and the digits it
has in place are counted too (a signal where whole keys are never right; chance is 1 in 10 a digit).

  rows = passkey_rows(generate, encode, decode, length=1024, depths=(0, 0.5, 1), trials=5)

`generate(prompts int32[B,P], new) -> int32[B,new]` is any decoder; `model_generate` is the greedy one
of a model (lra_core.decoding.generate, or its family's own loop). `python -m lra_core.evaluate
--passkey` runs it on a workdir's checkpoint at each --lengths (lra_core/evaluate.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import jax
import numpy as np

from lra_core import decoding
from lra_core.errors import ConfigError

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
KEY_SENTENCE = "The pass key is {key}. Remember it."
QUESTION = "What is the pass key? The pass key is"
NUMBER = re.compile(r"\s*(\d+)")

Generate = Callable[[np.ndarray, int], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Prompt:
  ids: np.ndarray  # int32[P]
  key: str
  depth: float  # asked for
  key_at: int  # the token where the key sentence starts
  filler: int  # filler tokens in the prompt: the key sits at depth key_at / filler


def answer_tokens(digits: int) -> int:
  """Tokens decoded after a prompt: the key's digits, the space before it and the full stop after."""
  return digits + 2


def draw_keys(seed: int, count: int, digits: int) -> list[str]:
  """`count` random keys of `digits` digits (no leading zero), the same for the same seed."""
  if digits < 1:
    raise ConfigError(f"a pass key needs at least one digit, got {digits}.")
  rng = np.random.default_rng(seed)
  return [str(rng.integers(10 ** (digits - 1), 10**digits)) for _ in range(count)]


def fixed_tokens(encode: Callable[[str], Sequence[int]], digits: int) -> int:
  """Tokens of a prompt and its answer that are not filler: the key sentence, the question, the answer."""
  key = KEY_SENTENCE.format(key="1" * digits)
  return len(list(encode(" " + key))) + len(list(encode(" " + QUESTION))) + answer_tokens(digits)


def check_length(encode: Callable[[str], Sequence[int]], length: int, digits: int) -> None:
  """One sentence where `length` positions cannot hold a prompt with no filler and its answer."""
  need = fixed_tokens(encode, digits)
  if length < need:
    raise ConfigError(
      f"passkey length {length} cannot hold the key sentence, the question and the answer ({need} tokens); "
      f"ask for {need} or more."
    )


def build_prompt(encode: Callable[[str], Sequence[int]], length: int, depth: float, key: str) -> Prompt:
  """The prompt of exactly `length` tokens with `key` at the sentence boundary nearest to `depth`."""
  if not 0.0 <= depth <= 1.0:
    raise ConfigError(f"passkey depth {depth} is outside [0, 1] (0: the start of the filler, 1: its end).")
  ids = lambda text: np.asarray(list(encode(" " + text)), np.int32)  # each piece after a space, as in running text
  key_ids, question = ids(KEY_SENTENCE.format(key=key)), ids(QUESTION)
  budget = length - len(key_ids) - len(question)
  if budget < 0:
    raise ConfigError(
      f"a passkey prompt of {length} tokens cannot hold the key and the question "
      f"({len(key_ids) + len(question)} tokens); ask for a longer length."
    )
  sentences = [ids(s) for s in FILLER]
  pieces, bounds = [], [0]
  while bounds[-1] < budget:
    pieces.append(sentences[len(pieces) % len(sentences)])
    bounds.append(bounds[-1] + len(pieces[-1]))
  # Cut from the front, so the filler ends on a whole sentence before the question.
  excess = bounds[-1] - budget
  filler = np.concatenate(pieces)[excess:] if pieces else np.zeros((0,), np.int32)
  # Its ends are boundaries too: depth 1 puts the key just before the question.
  starts = [0] + [b - excess for b in bounds if b > excess]
  at = min(starts, key=lambda b: abs(b - depth * budget))
  prompt = np.concatenate([filler[:at], key_ids, filler[at:], question]).astype(np.int32)
  return Prompt(ids=prompt, key=key, depth=depth, key_at=at, filler=budget)


def score(continuation: str, key: str) -> tuple[bool, int]:
  """(whether the first number of `continuation` is `key`, how many of the key's digits it has in place)."""
  found = NUMBER.match(continuation)
  answer = found.group(1) if found else ""
  return answer == key, sum(a == b for a, b in zip(answer, key))


def passkey_rows(
  generate: Generate,
  encode: Callable[[str], Sequence[int]],
  decode: Callable[[np.ndarray], str],
  length: int,
  depths: Sequence[float],
  trials: int,
  *,
  digits: int = 5,
  seed: int = 0,
  batch_size: int = 0,
) -> list[dict]:
  """One row per depth: the accuracy of `trials` keys (the same keys at every length for a seed) at
  `length` positions, prompt and answer together. `batch_size` prompts go to `generate` at once
  (0: all); a last short batch is filled up with its final prompt, so every call has one shape."""
  if trials < 1:
    raise ConfigError(f"passkey trials must be at least 1, got {trials}.")
  check_length(encode, length, digits)
  new = answer_tokens(digits)
  keys = draw_keys(seed, trials, digits)
  prompts = [build_prompt(encode, length - new, depth, key) for depth in depths for key in keys]
  ids = np.stack([p.ids for p in prompts])
  size = batch_size or len(ids)
  answers = []
  for start in range(0, len(ids), size):
    chunk = ids[start : start + size]
    filled = np.concatenate([chunk, np.repeat(chunk[-1:], size - len(chunk), axis=0)])
    answers.extend(np.asarray(generate(filled, new))[: len(chunk)])
  rows = []
  for i, depth in enumerate(depths):
    mine = range(i * trials, (i + 1) * trials)
    scores = [score(decode(np.asarray(answers[j])), prompts[j].key) for j in mine]
    rows.append(
      dict(
        length=length,
        depth=float(depth),
        key_depth=float(np.mean([prompts[j].key_at / max(prompts[j].filler, 1) for j in mine])),
        trials=trials,
        accuracy=float(np.mean([right for right, _ in scores])),
        digit_accuracy=float(np.mean([placed / digits for _, placed in scores])),
      )
    )
  return rows


def model_generate(model, family_generate: Callable | None = None, *, seed: int = 0) -> Generate:
  """The greedy decoder of `model`: its family's own loop where it has one (returning the new tokens),
  else lra_core.decoding.generate (returning prompt and new tokens, of which the new are kept)."""

  def run(prompts: np.ndarray, new: int) -> np.ndarray:
    key = jax.random.key(seed)  # greedy: the key is never drawn from
    if family_generate is not None:
      return np.asarray(family_generate(model, prompts, max_new_tokens=new, key=key, temperature=0.0))
    out = decoding.generate(model, prompts, max_new_tokens=new, key=key, temperature=0.0)
    return np.asarray(out)[:, prompts.shape[1] :]

  return run
