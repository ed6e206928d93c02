"""Block Transformer (Ho et al. 2024) and the vanilla Pythia baselines it is compared with, on C4.

  python -m lra_core.train --config=configs/c4/block_transformer.py:85m \
      --config.data.dir=/data/c4/en --workdir=runs/c4_block_85m
  python -m lra_core.train --config=configs/c4/block_transformer.py:85m,uptrain \
      --config.train.init_from=runs/c4_vanilla_170m --workdir=runs/c4_block_85m_uptrained

Sizes (non-embedding parameters, Table 3; both decoders Pythia layers: parallel residual,
LayerNorm, GELU MLP 4D, biases, rotary on 25% of each head):
  block   5m  : L_B 4, lookup embedder, prefix 2; block and token decoders 3 layers, d 256, 8 heads
          19m : 3 layers, d 512, 8 heads       85m : 6 layers, d 768, 12 heads
          302m: 12 layers, d 1024, 16 heads    805m: 8 layers, d 2048, 16 heads
          1.2b: 12 layers, d 2048, 16 heads
  vanilla 5m: 6 layers, d 256, 8 heads; 19m: 6, 512, 8; 85m: 12, 768, 12; 302m: 24, 1024, 16.
  megabyte (Table 4; summation token decoder of context 4):
          5m : token 4 layers d 128 4 heads, block 5 layers d 256 8 heads
          19m: token 4, 256, 8; block 5, 512, 8      85m: token 4, 512, 8; block 11, 768, 12
          (Table 4 calls the last one 85M; 2 nL (12 D^2 + 13 D) gives 90.6M.)
Training (Table 3, G.1): context 2048 (block decoder 512 blocks), batch 256 (512 for 805m and 1.2b),
lr 1e-3 (5m, 19m), 6e-4 (85m), 3e-4 (302m, 805m), 2e-4 (1.2b), 300B tokens: 572,000 steps at batch
256, 286,000 at 512. The optimizer is the authors' (their public training configs; the paper does
not print it): AdamW b1 .9 b2 .95 eps 1e-8, weight decay 0.1 (here never on 1-D parameters), linear
warmup of 3,000 steps (1,500 at batch 512: the same 1.6B tokens), cosine decay to 10%, gradient
clipping 1.0. Uptraining (Section 3.7, G.8, Appendix N) runs 10% of those steps (57,200 / 28,600,
30B tokens) with the same warmup. Block models train with random-length padding
(data.block_padding = L_B, Appendix H). The paper trains on the Pile with GPT-NeoX's BPE
(50,304 ids); that tokenizer is not part of C4, so the data reads T5's 32k SentencePiece vocabulary
(as configs/c4/transformer.py) inside the paper's 50,304-row tables.

Args (comma-separated): one size (default 302m, the paper's default for its analyses, G.4), and
  vanilla             the Pythia baseline of that size (5m, 19m, 85m, 302m)
  megabyte            the MEGABYTE-style model of that size (5m, 19m, 85m)
  encoder, cls        embedder ablations (Appendix F.1: 3 layers of 256; cls reads 3 CLS tokens)
  summation, cross    token decoder ablations (Appendix F.2)
  uptrain             the lookup embedder reads d_model-wide embeddings through a projection, so
                      train.init_from can name a vanilla run of twice the layers (Section 3.7);
                      10% of the training steps
  tiny                bytes, d 64, 2 + 2 layers, L_B 4, context 64, 4 steps
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.data.datasets import c4
from lra_core.data.tokenizer import ByteTokenizer
from lra_core.errors import ConfigError
from lra_core.models import block_transformer, transformer
from lra_core.run import optim_settings

T5_VOCAB_MODEL = "sentencepiece.model"
VOCAB = 50304
# size: (layers, width, heads) of each decoder, lr (Table 3).
BLOCK = {
  "5m": (3, 256, 8, 1e-3),
  "19m": (3, 512, 8, 1e-3),
  "85m": (6, 768, 12, 6e-4),
  "302m": (12, 1024, 16, 3e-4),
  "805m": (8, 2048, 16, 3e-4),
  "1.2b": (12, 2048, 16, 2e-4),
}
VANILLA = {"5m": (6, 256, 8, 1e-3), "19m": (6, 512, 8, 1e-3), "85m": (12, 768, 12, 6e-4), "302m": (24, 1024, 16, 3e-4)}
# size: token decoder (layers, width, heads), block decoder (layers, width, heads), lr (Table 4).
MEGABYTE = {
  "5m": ((4, 128, 4), (5, 256, 8), 1e-3),
  "19m": ((4, 256, 8), (5, 512, 8), 1e-3),
  "85m": ((4, 512, 8), (11, 768, 12), 6e-4),
}
ABLATIONS = ("encoder", "cls", "summation", "cross")


# Steps of the 300B-token runs and their warmup, by batch size (the authors' training configs).
STEPS = {256: 572_000, 512: 286_000}
WARMUP = {256: 3_000, 512: 1_500}
UPTRAIN_FRACTION = 0.1  # Section 3.7: uptraining takes 10% of the pretraining steps


def authors_optim(lr: float, warmup: int):
  """AdamW b2 .95, weight decay 0.1, linear warmup, cosine decay to 10% of lr, clipping 1.0."""
  c = optim_settings.default_config()
  c.update(
    dict(
      name="adamw",
      lr=lr,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,
      clip_norm=1.0,
      schedule="cosine",
      warmup_steps=warmup,
      min_lr_ratio=0.1,
    )
  )
  return c


def vanilla_model(layers: int, width: int, heads: int):
  """Pythia: the transformer baseline with GPT-NeoX layers, rotary on 25%, untied output."""
  return transformer.model_config(
    "transformer",
    vocab_size=VOCAB,
    d_model=width,
    num_layers=layers,
    num_heads=heads,
    d_ff=4 * width,
    position="none",
    rope=True,
    rope_fraction=0.25,
    use_bias=True,
    parallel_residual=True,
  )


def get_config(arg=None):
  parts = config_arg(arg, (*BLOCK, "vanilla", "megabyte", *ABLATIONS, "uptrain", "tiny"))
  sizes = [p for p in parts if p in BLOCK]
  if len(sizes) > 1:
    raise ConfigError(f"give one model size of {list(BLOCK)}; got {sorted(sizes)}.")
  # The paper's default for its analyses (Appendix G.4); tiny shrinks the 5m model.
  size = sizes[0] if sizes else "5m" if "tiny" in parts else "302m"
  table = VANILLA if "vanilla" in parts else MEGABYTE if "megabyte" in parts else BLOCK
  if size not in table:
    raise ConfigError(
      f"size {size!r} has no {'vanilla' if table is VANILLA else 'MEGABYTE'} model in the "
      f"paper; expected one of {list(table)}."
    )
  if "vanilla" in parts and parts & {"megabyte", "uptrain", *ABLATIONS}:
    raise ConfigError("config arg 'vanilla' builds the baseline transformer; it takes no Block Transformer args.")

  if "vanilla" in parts:
    layers, width, heads, lr = VANILLA[size]
    model = vanilla_model(layers, width, heads)
  elif "megabyte" in parts:
    (tl, tw, th), (layers, width, heads), lr = MEGABYTE[size]
    model = block_transformer.model_config(
      vocab_size=VOCAB,
      d_model=width,
      num_layers=layers,
      num_heads=heads,
      token_d_model=tw,
      token_num_layers=tl,
      token_num_heads=th,
      token_decoder="summation",
    )
  else:
    layers, width, heads, lr = BLOCK[size]
    model = block_transformer.model_config(vocab_size=VOCAB, d_model=width, num_layers=layers, num_heads=heads)
  if parts & {"encoder", "cls"}:
    model.embedder = "cls" if "cls" in parts else "encoder"
  if parts & {"summation", "cross"}:
    model.token_decoder = "cross" if "cross" in parts else "summation"
  if "uptrain" in parts:
    model.embed_width = model.d_model

  batch = 512 if size in ("805m", "1.2b") else 256
  steps = STEPS[batch]
  if "uptrain" in parts:
    steps = round(steps * UPTRAIN_FRACTION)
  data = c4.data_config(tokenizer=T5_VOCAB_MODEL, packing="concat")
  config = base_config(task="lm", model=model, data=data, optim=authors_optim(lr, WARMUP[batch]))
  config.train.update(
    dict(steps=steps, batch_size=batch, seq_len=2048, eval_every=5000, eval_batches=50, checkpoint_every=5000)
  )
  if model.name == "block_transformer":
    config.data.block_padding = model.block_len

  if "tiny" in parts:
    config.data.tokenizer = "bytes"
    small = dict(vocab_size=ByteTokenizer.vocab_size, d_model=64, num_layers=2, num_heads=4)
    if model.name == "block_transformer":
      small.update(
        token_d_model=32 if "megabyte" in parts else 0,
        token_num_layers=2,
        token_num_heads=2 if "megabyte" in parts else 0,
        encoder_width=32,
        encoder_layers=1,
        encoder_heads=2,
        embed_width=64 if "uptrain" in parts else 0,
      )
    else:
      small.update(num_layers=4, d_ff=256)
    config.model.update(small)
    tiny_train(config, seq_len=64)
  return config
