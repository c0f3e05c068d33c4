"""Training the miniature K2 -> K2.5 world: corpus, tokenizer, targets A and B, EAGLE-3 drafters."""
from engine.train.cli import train_command

__all__ = ["train_command"]
