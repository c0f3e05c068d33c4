"""The bundled speculative-decoding engine (the reading path: config -> model -> cache -> graphs -> decoding -> tree
-> drafter -> speculate). Importing it lets a background process of a runner's timing lock hold its device before
any device work (engine.quiet; nothing happens without the runner's variables)."""
from engine import quiet as _quiet

_quiet.hold()
