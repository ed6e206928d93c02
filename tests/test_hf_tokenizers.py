"""Published models' tokenizers as `data.tokenizer`: a Hugging Face tokenizer.json (GPT-NeoX's byte-level
BPE, Gemma's with its <bos> post-processor) gives the ids the `tokenizers` library gives, which is what
Hugging Face's fast tokenizers run; a SentencePiece model that defines bos (Gemma's, Llama's) starts each
document with it, as their tokenizers do, and one without (ours, T5's) is unchanged. Fixtures are trained
here, tiny."""

import json

import numpy as np
import pytest
import sentencepiece as spm
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from lra_core.data import tokenizer as tok
from lra_core.errors import DataError

TEXT = (
  "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!\n"
  "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow. 0123456789 ÅÉÎ."
)
SAMPLE = "A lazy fox, five quick zebras and 42 jugs."


def neox_like(folder, bos=False):
  """A byte-level BPE with <|endoftext|> (GPT-NeoX's kind), and optionally a post-processor that starts
  every encoding with <bos> (Gemma's kind), saved with the tokenizer_config.json naming eos."""
  t = tokenizers.Tokenizer(models.BPE())
  t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  t.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<pad>", "<bos>"]
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  t.train_from_iterator([TEXT] * 20, trainer)
  if bos:
    t.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
  folder.mkdir(parents=True, exist_ok=True)
  t.save(str(folder / "tokenizer.json"))
  config = {"eos_token": "<|endoftext|>", "pad_token": {"content": "<pad>", "lstrip": False}}
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  return folder / "tokenizer.json"


@pytest.mark.parametrize("bos", [False, True])
def test_a_tokenizer_json_gives_the_ids_the_tokenizers_library_gives(tmp_path, bos):
  path = neox_like(tmp_path / "tok", bos=bos)
  ours = tok.make_tokenizer(str(path))
  reference = tokenizers.Tokenizer.from_file(str(path))
  want = reference.encode(SAMPLE).ids
  assert ours.encode(SAMPLE).tolist() == want and (want[0] == 2) == bos
  assert [x.tolist() for x in ours.encode_many([SAMPLE, TEXT])] == [want, reference.encode(TEXT).ids]
  assert (ours.eos_id, ours.pad_id) == (0, 1) and ours.decode(ours.encode(SAMPLE)) == SAMPLE
  # a piece with the byte-level space mark begins a word
  pieces = [reference.id_to_token(i) for i in want]
  starts = ours.word_starts(np.zeros(len(want), np.int32), np.asarray(want))
  assert starts.tolist() == [p.startswith("\u0120") for p in pieces] and starts.any()


def test_a_tokenizer_json_without_a_named_eos_is_one_sentence(tmp_path):
  path = neox_like(tmp_path / "tok")
  (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<missing>"}))
  tok._load.cache_clear()
  with pytest.raises(DataError, match="names no eos_token in the vocabulary"):
    tok.make_tokenizer(str(path))


def sentencepiece_model(folder, bos: bool):
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "text.txt").write_text(TEXT * 20)
  ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if bos else dict(pad_id=0, eos_id=1, bos_id=-1, unk_id=2)
  spm.SentencePieceTrainer.train(
    input=str(folder / "text.txt"), model_prefix=str(folder / "m"), vocab_size=80, model_type="bpe", **ids
  )
  return str(folder / "m.model")


@pytest.mark.parametrize("bos", [False, True])
def test_a_sentencepiece_model_with_bos_starts_each_document_with_it(tmp_path, bos):
  path = sentencepiece_model(tmp_path / ("bos" if bos else "plain"), bos)
  ours, reference = tok.make_tokenizer(path), spm.SentencePieceProcessor(model_file=path)
  want = ([2] if bos else []) + reference.encode(SAMPLE)
  assert ours.encode(SAMPLE).tolist() == want
  assert [x.tolist() for x in ours.encode_many([SAMPLE])] == [want]
  assert ours.decode(ours.encode(SAMPLE)) == reference.decode(reference.encode(SAMPLE))
  # encoded documents cached under the old behaviour are not reused for a model with bos
  assert ours.fingerprint().startswith("spm+bos:" if bos else "spm:")
