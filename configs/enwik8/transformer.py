"""Byte-level language modelling on enwik8 with the Transformer baselines.

  python -m lra_core.train --config=configs/enwik8/transformer.py:plusplus \
      --config.data.dir=/path/to/enwik8_folder --workdir=runs/enwik8_tfmpp

Reads enwik8.zip (or the raw file) from data.dir, splits it 90/5/5 % (90M/5M/5M bytes for the
full file). This baseline's size is ours, not a paper table: 8 layers, d 512, 8 heads, MLP 2048,
context 1024, AdamW as Transformer-VQ's enwik8 runs (b2 .98, eps 1e-9, clip 0.1, lr 4e-4 with
warmup and cosine decay to 0.1x).
Args (comma-separated): plus / plusplus (Transformer+ / ++), mlm (masked LM on the same bytes,
bidirectional), tiny.
"""

from lra_core import optim
from lra_core.config import base_config, config_arg, tiny_train
from lra_core.data import bytes as bytes_data
from models import transformer


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "plus", "plusplus", "mlm"))
  variant = "transformer++" if "plusplus" in parts else "transformer+" if "plus" in parts else "transformer"
  mlm = "mlm" in parts
  model = transformer.model_config(variant, vocab_size=257 if mlm else 256, d_model=512, num_layers=8,
                                   num_heads=8, d_ff=2048, dropout=0.1)
  opt = optim.default_config()
  opt.update(dict(name="adamw", lr=4e-4, b1=0.9, b2=0.98, eps=1e-9, clip_norm=0.1, schedule="cosine",
                  warmup_steps=4000, min_lr_ratio=0.1, weight_decay=0.0))
  config = base_config(task="mlm" if mlm else "lm", model=model,
                       data=bytes_data.data_config(filename="enwik8.zip"), optim=opt)
  config.train.update(dict(steps=100_000, batch_size=32, seq_len=1024, eval_every=5000, eval_batches=50,
                           checkpoint_every=5000))
  if "tiny" in parts:
    config.model.update(dict(d_model=64, num_layers=2, num_heads=4, d_ff=128))
    tiny_train(config, seq_len=64)
  return config
