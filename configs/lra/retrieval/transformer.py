"""LRA Retrieval (ACL Anthology Network document matching), two-tower Transformer baselines.

  python -m lra_core.train --config=configs/lra/retrieval/transformer.py \
      --config.data.dir=/path/to/lra_release/tsv_data/ --workdir=runs/retrieval

Both documents go through the same encoder separately and meet only in the head
([e1, e2, e1*e2, e1-e2] -> MLP), as LRA intends: no cross-attention between documents.
Args (comma-separated): plus / plusplus select Transformer+ / Transformer++; tiny shrinks
everything for a smoke test.
Settings: LRA public matching config (4 layers, d 128, 4 heads, MLP 512, length 4000 per
document, batch 32, 5000 steps, lr factor 0.05 with rsqrt decay after 8000 warmup, wd 0.1).
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.configs.lra.common import lra_optim, lra_transformer
from lra_core.data.datasets.lra import retrieval


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "plus", "plusplus"))
  model = lra_transformer(
    parts,
    vocab_size=retrieval.VOCAB_SIZE,
    num_classes=2,
    d_model=128,
    num_layers=4,
    num_heads=4,
    d_ff=512,
    classifier_hidden=512,
  )
  config = base_config(
    task="retrieval", model=model, data=retrieval.data_config(), optim=lra_optim(lr=0.05, warmup=8000, weight_decay=0.1)
  )
  config.train.update(dict(steps=5000, batch_size=32, seq_len=4000, eval_every=500, checkpoint_every=1000))
  if "tiny" in parts:
    config.model.update(dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, classifier_hidden=32))
    tiny_train(config, seq_len=64)
  return config
