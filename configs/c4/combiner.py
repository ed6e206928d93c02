"""Combiner-Axial on C4 (the baseline of Hua et al. 2022, Tables 6 and 8): masked language
modelling, or causal LM.

  python -m lra_core.train --config=configs/c4/combiner.py \
      --config.data.dir=/data/c4/en --config.data.train_files='c4-train.000*-of-01024.json.gz' \
      --workdir=runs/c4_combiner_mlm

Table 8: 12 attention + 12 MLP layers of d 768, 12 heads, softmax attention in the row-major axial
pattern (models/combiner.py), GELU MLP 3072, ScaleNorm, scaled sinusoid + RoPE, tied embeddings:
124M parameters (`python scripts/param_counts.py`). Data, vocabulary, training and optimizer as
configs/c4/flash.py (Table 6). The paper gives no row length; model.chunk is 128.

Args (comma-separated):
  lm      causal LM with the Wiki-40B setting of Tables 7 and 9 (LayerNorm) instead of MLM
  tiny    bytes tokenizer, 2 layers, d 32, context 64, rows of 16, 4 steps.
"""

from lra_core.config import config_arg
from lra_core.configs.c4.flash import tiny
from lra_core.configs.c4.transformer import EMBED_VOCAB, flash_setting
from lra_core.models import combiner


def get_config(arg=None):
  parts = config_arg(arg, ("tiny", "lm"))
  mlm = "lm" not in parts
  model = combiner.model_config(vocab_size=EMBED_VOCAB, norm="scale" if mlm else "layer")
  config = flash_setting(model, mlm=mlm)
  if "tiny" in parts:
    tiny(config, mlm=mlm)
  return config
