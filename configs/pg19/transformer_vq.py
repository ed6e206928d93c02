"""Transformer-VQ on PG-19 (Lingle 2024, Table 10 PG-19 column and appendix C).

  python -m lra_core.data.tokenizer --train --input=/data/pg19/train \
      --model_prefix=/data/pg19/spm_bpe32k --vocab_size=32000
  python -m lra_core.train --config=configs/pg19/transformer_vq.py \
      --config.data.dir=/data/pg19 --workdir=runs/pg19_vq

1.3B parameters: 48 GAUs of d_model 2048, d_k 128, d_v 4096, one head, 512 codes, blocks of 512;
SentencePiece BPE 32k learned on PG-19; sequences of 8192 tokens in update windows of 2048; batch
128, 500k steps; Adafactor lr 0.01 (relative step sizes, update clip 1.0, beta1 0), 10k warmup
then cosine decay to 0.1x, no weight decay; sinusoid, residual and layer dropout .1 each; final
RMS norm and a classifier tied to the embedding (C.2: large models), as the authors' scripts set it
(e_tie=1, e_preln=1, e_scale=0.005): logits = (x E^T + b) * 0.005 with a learned output bias b. The
embedding table stores E itself, as theirs (model.embedding=plain, the family's default).
Args (comma-separated):
  full         the same model with unquantized quadratic attention.
  tiny         bytes tokenizer, 2 GAUs, d 32, 16 codes, blocks of 8, sequences of 64 in windows of 16.
"""

from lra_core.config import base_config, config_arg
from lra_core.configs.presets import transformer_vq as vq_presets
from lra_core.data.datasets import pg19
from lra_core.data.tokenizer import ByteTokenizer
from lra_core.models import transformer_vq

SPM_VOCAB = 32000
SPM_MODEL = "spm_bpe32k.model"  # relative: resolved under data.dir


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "full"))
  model = transformer_vq.model_config(
    **vq_presets.PAPER_SIZES["1.3B"],
    vocab_size=SPM_VOCAB,
    dropsin=0.1,
    dropres=0.1,
    droplyr=0.1,
    final_norm=True,
    tie_embeddings=True,
    output_scale=0.005,
  )
  config = base_config(
    task="lm", model=model, data=pg19.data_config(tokenizer=SPM_MODEL), optim=vq_presets.paper_optim("adafactor")
  )
  config.train.update(
    dict(
      steps=500_000,
      batch_size=128,
      seq_len=8192,
      update_len=2048,
      eval_every=5000,
      eval_batches=50,
      checkpoint_every=5000,
    )
  )
  if "full" in parts:
    config.model.attention = "full"
  if "tiny" in parts:
    config.data.tokenizer = "bytes"
    config.model.vocab_size = ByteTokenizer.vocab_size
    vq_presets.tiny(config, seq_len=64, update_len=16)
  return config
