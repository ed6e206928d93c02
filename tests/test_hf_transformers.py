"""Our Hugging Face folders read by Hugging Face transformers itself, where it is installed (with torch):
a tiny GPT-NeoX and Gemma 2 written by `hf.save_folder` with each RoPE scaling type give transformers'
logits (float64), whole vocabulary, at four times the length the frequencies were trained at. Skipped
without transformers (not a dependency of the project): `pip install torch transformers` to run it."""

import numpy as np
import pytest
from flax import nnx
from test_hf_gemma2 import CONFIG as GEMMA2

from lra_core import hf
from lra_core.models import transformer
from lra_core.protocol import RunInfo

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TRAINED, LENGTH = 6, 24  # each scaling reads 4x the length its frequencies were trained at
SCALINGS = [
  dict(type="none"),
  dict(type="linear", factor=2.0),
  dict(type="dynamic", factor=2.0, original_max_len=TRAINED),
  dict(type="yarn", factor=4.0, original_max_len=TRAINED),
  dict(type="llama3", factor=4.0, original_max_len=TRAINED, low_freq_factor=1.0, high_freq_factor=4.0),
]
NEOX = dict(
  vocab_size=50,
  d_model=64,
  num_layers=2,
  num_heads=4,
  d_ff=128,
  max_len=LENGTH,
  norm="layer",
  use_bias=True,
  parallel_residual=True,
  embedding="plain",
  position="none",
  rope=True,
  rope_fraction=0.25,
  rope_max_wavelength=500.0,
  activation="gelu",
)


def sections():
  yield "gpt_neox", transformer.model_config("transformer", **NEOX)
  yield "gemma2", hf.gemma2.model_section(dict(GEMMA2, max_position_embeddings=LENGTH))


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["type"])
@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_transformers_reads_our_folder_as_our_model_computes(tmp_path, scaling, layout):
  if layout == "v5" and int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("transformers before 5 reads only the v4 layout")
  for name, section in sections():
    section.rope_scaling.update(scaling)
    model = transformer.Model(section, RunInfo(task="lm", seq_len=LENGTH), rngs=nnx.Rngs(params=1))
    hf.save_folder(tmp_path / name, section, model, layout=layout)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / name, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    ids = np.random.RandomState(0).randint(0, section.vocab_size, size=(1, LENGTH))
    with torch.no_grad():
      expected = theirs(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), expected, atol=1e-5, err_msg=f"{name} {scaling['type']}")
