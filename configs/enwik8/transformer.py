"""Byte-level language modelling on enwik8 with the Transformer baselines.

  python -m lra_core.train --config=configs/enwik8/transformer.py:plusplus \
      --config.data.dir=/path/to/enwik8_folder --workdir=runs/enwik8_tfmpp

Reads enwik8.zip (or the raw file) from data.dir, splits it 90/5/5 % (90M/5M/5M bytes for the
full file). This baseline's size is ours, not a paper table: 8 layers, d 512, 8 heads, MLP 2048,
context 1024, AdamW as Transformer-VQ's enwik8 runs (b2 .98, eps 1e-9, clip 0.1, lr 4e-4 with
warmup and cosine decay to 0.1x).
Args (comma-separated):
  (none)          the baseline above.
  plus, plusplus  Transformer+ (RoPE) / Transformer++ (RoPE + GLU).
  vq              Transformer-VQ's enwik8 setting (Lingle 2024, Table 10 enwik8 column, appendix
                  C.1): sequences of 8192 bytes trained in update windows of 2048 (backprop length),
                  batch 128, 125k steps, AdamW lr 4e-4 (b1 .9, b2 .98, eps 1e-9, clip 0.1) with
                  10k warmup then cosine decay to 0.1x, weight decay 2e-4 on a constant schedule,
                  residual dropout 0.5, d_model 768. The paper's model is a 190M Transformer-VQ of
                  48 GAUs; this baseline has 24 layers of attention + MLP (one layer ~ two GAUs),
                  6 heads of 128 (= d_k), MLP 3072: 177M parameters. It carries no cache across
                  update windows, so its context is the 2048-byte window; sinusoid dropout (.2)
                  and layerdrop (.3) belong to the VQ model.
  mlm             masked LM on the same bytes, bidirectional.
  tiny            2 layers, d 64, context 64 (vq: windows of 16), 4 steps.
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.data.datasets import bytes as bytes_data
from lra_core.models import transformer
from lra_core.run import optim_settings


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "plus", "plusplus", "mlm", "vq"))
  variant = "transformer++" if "plusplus" in parts else "transformer+" if "plus" in parts else "transformer"
  mlm = "mlm" in parts
  model = transformer.model_config(
    variant, vocab_size=257 if mlm else 256, d_model=512, num_layers=8, num_heads=8, d_ff=2048, dropout=0.1
  )
  opt = optim_settings.default_config()
  opt.update(
    dict(
      name="adamw",
      lr=4e-4,
      b1=0.9,
      b2=0.98,
      eps=1e-9,
      clip_norm=0.1,
      schedule="cosine",
      warmup_steps=4000,
      min_lr_ratio=0.1,
      weight_decay=0.0,
    )
  )
  config = base_config(
    task="mlm" if mlm else "lm", model=model, data=bytes_data.data_config(filename="enwik8.zip"), optim=opt
  )
  config.train.update(
    dict(steps=100_000, batch_size=32, seq_len=1024, eval_every=5000, eval_batches=50, checkpoint_every=5000)
  )
  if "vq" in parts:  # Transformer-VQ, Table 10 (enwik8 column) and appendix C.1
    config.model.update(dict(d_model=768, num_layers=24, num_heads=6, d_ff=3072, dropout=0.5))
    config.optim.update(dict(warmup_steps=10_000, weight_decay=2e-4, weight_decay_schedule="constant"))
    config.train.update(dict(steps=125_000, batch_size=128, seq_len=8192, update_len=2048))
  if "tiny" in parts:
    config.model.update(dict(d_model=64, num_layers=2, num_heads=4, d_ff=128))
    tiny_train(config, seq_len=64)
    config.train.update_len = 16 if "vq" in parts else 0
  return config
