"""Gemma 2 2B and Gemma-Macchiato (Latte, Section 4.5, Tables 4 and 6), started from the published
Gemma 2 2B checkpoint (a Hugging Face folder: docs/checkpoints.md).

  python -m lra_core.train --config=configs/c4/gemma2.py --config.train.init_from=hf:/ckpt/gemma-2-2b \
      --config.data.dir=/data/c4/en --config.data.tokenizer=/ckpt/gemma-2-2b/tokenizer.model \
      --workdir=runs/gemma2_macchiato

Latte replaces every attention of the pre-trained Gemma 2 2B by a Latte-Macchiato layer whose sliding
window of 128 steps takes the Gemma attention's weights, keeps every other Gemma weight, and trains
only the Latte-specific weights (the latent states' query and key logits; `optim.groups` freezes the
rest). Table 6: L 128, window 128, lr 6e-4 with 2,000 warmup steps and cosine decay, 100,000
iterations, sequences of 4,096 tokens, batch 4, Gemma 2's tokenizer, every Gemma setting otherwise
kept; four 80 GB A100s for a day (`mesh.fsdp` 4 here). The optimizer's betas, epsilon, clipping and
weight decay are the Latte configs' (configs/c4/latte.py); Table 6 does not print them. The paper trains
on SlimPajama; this config reads C4, web text of the same kind, tokenized by the checkpoint's
SentencePiece model. Table 4 evaluates at 4K, 8K and 16K tokens (`--config.train.seq_len`).

The architecture is Gemma 2 2B's published config.json (`GEMMA2_2B`) read by lra_core/hf/gemma2.py, so
the model a run builds is the one its checkpoint fills: 2,614,341,888 parameters as the transformer
("gemma"), the count Gemma 2's release gives.

Args (comma-separated):
  (none)   Gemma-Macchiato: the Latte family, every layer a Macchiato (window 128, L 128, no
           convolution or RG-LRU: the window attention is the pre-trained model's), frozen Gemma weights.
  gemma    Gemma 2 2B itself, the transformer family (the baseline of Table 4; its sliding window 4096
           on every other layer).
  tiny     a 2-layer Gemma of width 64 over bytes, as a smoke test of either.
"""

from lra_core.config import base_config, config_arg, tiny_train
from lra_core.data.datasets import c4
from lra_core.data.tokenizer import ByteTokenizer
from lra_core.hf import gemma2
from lra_core.models import latte
from lra_core.run import optim_settings

# google/gemma-2-2b's config.json (the settings lra_core/hf/gemma2.py reads).
GEMMA2_2B = {
  "architectures": ["Gemma2ForCausalLM"],
  "vocab_size": 256000,
  "hidden_size": 2304,
  "intermediate_size": 9216,
  "num_hidden_layers": 26,
  "num_attention_heads": 8,
  "num_key_value_heads": 4,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "max_position_embeddings": 8192,
  "rms_norm_eps": 1e-6,
  "rope_theta": 10000.0,
  "query_pre_attn_scalar": 256,
  "sliding_window": 4096,
  "attn_logit_softcapping": 50.0,
  "final_logit_softcapping": 30.0,
  "tie_word_embeddings": True,
}
TINY = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
TINY |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)
WINDOW, LATENTS = 128, 128  # Table 6
TOKENIZER = "tokenizer.model"  # the checkpoint's SentencePiece model; relative: resolved under data.dir
# Everything but the Latte-specific weights (a layer's attn/query and attn/key: the latent logits) is frozen.
FROZEN = r"^(?!.*/attn/(query|key)/)"


def macchiato(section):
  """The Latte-Macchiato section around a Gemma 2 transformer section: the same widths, norms, MLP and
  output; every layer a Macchiato whose window attention reads the Gemma attention's weights."""
  m = latte.model_config("latte_conv_swa++")
  keep = {k: v for k, v in section.items() if k in m and k not in ("name", "variant", "num_kv_heads", "scan_layers")}
  m.update(keep)
  m.update(dict(mixer="none", window=WINDOW, num_latents=LATENTS, global_every=0, vapor=False, latent=True))
  return m


def get_config(arg=None):
  parts = config_arg(arg, ("gemma", "tiny"))
  hf_config = GEMMA2_2B | (TINY if "tiny" in parts else {})
  section = gemma2.model_section(hf_config)
  model = section if "gemma" in parts else macchiato(section)
  model.max_len = 0  # positions are rotary: any length (Table 4 reads 8K and 16K; the release says 8,192)
  opt = optim_settings.default_config()
  opt.update(
    dict(name="adamw", lr=6e-4, schedule="cosine", warmup_steps=2000, b1=0.9, b2=0.95, eps=1e-8, clip_norm=1.0)
  )
  opt.weight_decay = 0.01
  if "gemma" not in parts:
    opt.groups = (dict(name="gemma", pattern=FROZEN, optimizer="none"),)
  config = base_config(task="lm", model=model, data=c4.data_config(tokenizer=TOKENIZER, packing="concat"), optim=opt)
  config.model.dtype = "bfloat16"
  config.train.update(dict(batch_size=4, seq_len=4096, steps=100_000, eval_every=5000, checkpoint_every=5000))
  config.mesh.fsdp = 4
  if "tiny" in parts:
    config.data.tokenizer = "bytes"
    config.model.dtype = "float32"
    config.mesh.fsdp = 1
    config.model.window = min(config.model.window, 8)
    config.model.num_latents = 8
    tiny_train(config, seq_len=64)
  return config
