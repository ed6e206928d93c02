"""LRA Retrieval (AAN document matching) with a two-tower bidirectional Latte (Dolga et al., Table 7).

  python -m lra_core.train --config=configs/lra/retrieval/latte.py:latte_rglru_swa++ \
      --config.data.dir=/path/to/lra_release/tsv_data/ --workdir=runs/retrieval_latte

Both documents go through the same encoder and meet only in the head ([e1, e2, e1*e2, e1-e2] ->
MLP), the two-tower setup of Appendix A.2.3. Args: one of configs.lra.common.LATTE_ARGS, tiny.
Table 7: 6 layers, 4 heads, L 40, D 128, lr 1e-4, batch 32, weight decay 0.01, dropout 0.1,
20 epochs of AAN's 147,086 training pairs, RoPE on the window; 4000 bytes per document.
"""

from lra_core.config import base_config, config_arg
from lra_core.configs.lra.common import LATTE_ARGS, epochs, lra_latte
from lra_core.configs.presets import latte as presets
from lra_core.data.datasets.lra import retrieval

TRAIN_EXAMPLES, BATCH_SIZE, EPOCHS = 147_086, 32, 20


def get_config(arg=None):
  parts = config_arg(arg, ("tiny",) + LATTE_ARGS)
  model, opt = lra_latte(
    parts,
    rope=True,
    lr=1e-4,
    weight_decay=0.01,
    dropout=0.1,
    vocab_size=retrieval.VOCAB_SIZE,
    num_classes=2,
    d_model=128,
    num_latents=40,
    classifier_hidden=128,
  )
  config = base_config(task="retrieval", model=model, data=retrieval.data_config(), optim=opt)
  config.train.update(seq_len=4000, **epochs(TRAIN_EXAMPLES, BATCH_SIZE, EPOCHS))
  if "tiny" in parts:
    presets.tiny(config, seq_len=64)
  return config
