"""A byte-level BPE tokenizer trained with `tokenizers`, saved as tokenizer.json (+ a tokenizer_config.json so that
transformers' AutoTokenizer loads it). Targets A and B share one tokenizer, as Kimi-K2 and K2.5 do."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.errors import EngineError
from engine.fsutil import atomic_write

EOS = "<|endoftext|>"  # id 0: document separator in the token stream and the models' eos


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    if not texts:
        raise EngineError("cannot train a tokenizer on an empty corpus")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / "tokenizer.json", lambda tmp: tok.save(str(tmp)))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
              "model_max_length": 1 << 20}
    atomic_write(path / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    f = Path(path)
    f = f / "tokenizer.json" if f.is_dir() else f
    if not f.is_file():
        raise EngineError(f"{f}: no tokenizer.json")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise EngineError(f"{f}: unreadable tokenizer ({e})") from None


def tokenizer_hash(path: str | Path) -> str | None:
    """Content hash of a directory's tokenizer.json (None when it has none): tells two vocabularies apart."""
    f = Path(path) / "tokenizer.json"
    return hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.is_file() else None


def eos_id(tok: Tokenizer) -> int:
    return tok.token_to_id(EOS)
