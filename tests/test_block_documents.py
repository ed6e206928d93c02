"""Block Transformer over packed documents (segment_ids) and with pad masking (model.mask_pads).

Documents: one that starts on a block boundary gives exactly the outputs it gets alone at the start
of a row (tests/oracles.py, assert_documents_independent); one that starts inside a block gives the
outputs it gets alone after as many pads as its block offset, and never reads the other document
(assert_documents_isolated). Pads: the token decoder and the encoder embedder (with
model.zero_pad_outputs) read no pad, so what the pad token embeds to changes no real token's output;
by default the encoder's projection reads its pad outputs, as the authors' embedder does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_block_transformer import PAD, VOCAB, L, make_config, make_model, tokens

import oracles
import tiers
from lra_core.models import block_transformer as bt

T = 24
DOC_A = (np.arange(8) * 3 + 1) % (VOCAB - 1) + 1  # two whole blocks, no pad token
DOC_B = (np.arange(9) * 5 + 2) % (VOCAB - 1) + 1  # ends inside a block

VARIANTS = [
  dict(),
  dict(token_decoder="summation", token_d_model=16, token_num_heads=2),
  dict(token_decoder="cross"),
  dict(embedder="encoder"),
]
IDS = ["prefix", "summation", "cross", "encoder"]


def apply_fn(model):
  return lambda rows, segs: oracles.forward(model, rows, segment_ids=segs)


@pytest.mark.parametrize("variant", tiers.quick(VARIANTS, keep=[0, 3], ids=IDS))
def test_a_document_on_a_block_boundary_is_independent_of_the_one_before(variant):
  model = make_model(make_config(seq_len=T, **variant))
  oracles.assert_documents_independent(apply_fn(model), DOC_A, DOC_B, T)


@pytest.mark.parametrize("variant", VARIANTS[:2], ids=IDS[:2])
def test_a_document_inside_a_block_reads_as_after_left_pads_and_never_reads_the_other(variant):
  model = make_model(make_config(seq_len=T, **variant))
  apply = apply_fn(model)
  for la in (5, 7):  # the second document starts at block offset 1, 3
    oracles.assert_documents_isolated(apply, DOC_A[:la], DOC_B, T, vocab=VOCAB)
    rows, segs = oracles.packed_pair(DOC_A[:la], DOC_B, T)
    s, lb = la % L, len(DOC_B)
    alone = jnp.full((1, T), PAD, jnp.int32).at[0, s : s + lb].set(DOC_B)
    alone_segs = jnp.zeros((1, T), jnp.int32).at[0, : s + lb].set(1)  # its pads belong to it (block padding)
    np.testing.assert_allclose(
      apply(rows[:1], segs[:1])[0, la : la + lb], apply(alone, alone_segs)[0, s : s + lb], atol=1e-5
    )


def test_two_documents_starting_in_one_block_stay_isolated():
  """Two documents start in block 0; the second reads no context embedding, and its pad
  (masked elsewhere) stays readable to it, so its pad position reads nothing of the first."""
  model = make_model(make_config(seq_len=T))
  doc_b = np.array([PAD, 4, 5, 6, 7, 8, 9])  # a left pad, as block padding writes
  oracles.assert_documents_isolated(apply_fn(model), DOC_A[:1], doc_b, T, vocab=VOCAB)


def test_one_document_per_row_equals_no_segment_ids():
  model = make_model(make_config(seq_len=T))
  apply = apply_fn(model)
  x = tokens(t=22)
  np.testing.assert_allclose(apply(x, jnp.ones_like(x)), apply(x, None), atol=1e-5)


def test_bad_segment_ids_shape_is_one_sentence():
  model = make_model(make_config(seq_len=T))
  with pytest.raises(ValueError, match="segment_ids shape"):
    model(tokens(t=8), segment_ids=jnp.ones((2, 7), jnp.int32))


# -- pad masking ------------------------------------------------------------------------------------


def padded_tokens():
  """Rows with pads inside blocks (left, middle and right of a block) and a whole pad block."""
  x = np.array(tokens(t=16))
  x[0, [0, 1, 6, 13]] = PAD
  x[1, [4, 5, 6, 7, 10]] = PAD
  return jnp.asarray(x)


def moved_pad_embeddings(model):
  """The model with other embeddings for the pad token (token decoder and encoder embedder)."""
  moved = nnx.clone(model)
  tables = [moved.token_embed.embedding]
  if isinstance(moved.embedder, bt.EncoderEmbedder):
    tables.append(moved.embedder.embed.embedding)
  for i, table in enumerate(tables):
    table[...] = table[...].at[PAD].set(jax.random.normal(jax.random.key(i), table.shape[1:]))
  return moved


@pytest.mark.parametrize(
  "variant",
  [
    dict(embedder="encoder", zero_pad_outputs=True),
    dict(token_decoder="summation"),
    dict(embedder="encoder", zero_pad_outputs=True, token_decoder="cross"),
  ],
  ids=["encoder,prefix", "lookup,summation", "encoder,cross"],
)
def test_pads_are_masked_in_the_token_decoder_and_encoder_embedder(variant):
  masked = make_model(make_config(**variant))
  unmasked = make_model(make_config(mask_pads=False, **variant))
  x, padded = tokens(t=16), padded_tokens()
  np.testing.assert_allclose(masked(x), unmasked(x), atol=1e-6)  # nothing changes without pads
  real = np.asarray(padded != PAD)
  # The lookup embedder reads pads by design (Appendix H); its table keeps the pad row.
  out = np.asarray(masked(padded))
  np.testing.assert_allclose(np.asarray(moved_pad_embeddings(masked)(padded))[real], out[real], atol=1e-5)
  assert not np.allclose(
    np.asarray(moved_pad_embeddings(unmasked)(padded))[real], np.asarray(unmasked(padded))[real], atol=1e-5
  )


def test_the_encoder_embedder_projects_its_pad_outputs_as_the_authors_do_unless_told_to_zero_them():
  """The authors' encoder embedder masks pads as keys and projects every position's output, so a
  padded block's embedding moves with the pad token's embedding and with the projection's rows for
  the pad positions; with zero_pad_outputs it is the projection of its real outputs alone."""
  blocks = jnp.asarray([[[PAD, PAD, 3, 4], [5, 6, 7, 8]]])  # a padded block, then an unpadded one

  def moved_pad_rows(model):  # other projection rows for positions 0 and 1 of every block
    moved, kernel = nnx.clone(model), model.embedder.proj.kernel[...]
    rows = kernel.reshape(L, -1, kernel.shape[-1])  # the projection reads [L, width] flattened
    rows = rows.at[:2].set(jax.random.normal(jax.random.key(3), rows[:2].shape))
    moved.embedder.proj.kernel[...] = rows.reshape(kernel.shape)
    return moved

  def moves(model, change, block):
    embed = lambda m: oracles.forward(m.embedder, blocks)[0, block]
    return not np.allclose(embed(change(model)), embed(model), atol=1e-4)

  kept = make_model(make_config(embedder="encoder"))
  zeroed = make_model(make_config(embedder="encoder", zero_pad_outputs=True))
  assert moves(kept, moved_pad_embeddings, 0) and moves(kept, moved_pad_rows, 0)
  assert not moves(zeroed, moved_pad_embeddings, 0) and not moves(zeroed, moved_pad_rows, 0)
  assert not moves(kept, moved_pad_embeddings, 1) and not moves(zeroed, moved_pad_embeddings, 1)
  assert moves(zeroed, moved_pad_rows, 1)  # the rows are read where the positions hold tokens


@pytest.mark.parametrize("variant", [dict(), dict(token_decoder="cross")], ids=["prefix", "cross"])
def test_decoding_masks_pads_as_the_forward_pass_does(variant):
  model = make_model(make_config(**variant))
  x = padded_tokens()
  oracles.assert_decode_matches_forward(model, x, model(x), atol=1e-4)
