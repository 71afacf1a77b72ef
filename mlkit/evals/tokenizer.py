"""A character-level tokenizer for the generated task alphabet.

Ids: 0 = PAD, 1 = BOS, 2 = EOS, then printable ASCII (space .. ~) in order, so
the vocabulary (98 ids) fits every small preset (TINY: 256, SMALL_MLA: 512).
"""

from __future__ import annotations

from typing import Sequence

PAD = 0
BOS = 1
EOS = 2
_FIRST_CHAR = 3
CHARS = "".join(chr(c) for c in range(32, 127))


class CharTokenizer:
  """Maps printable-ASCII text to ids and back; immutable and stateless.

  Attributes:
    vocab_size: ids used (98); a model's vocab_size must be at least this.
  """

  pad_id = PAD
  bos_id = BOS
  eos_id = EOS
  vocab_size = _FIRST_CHAR + len(CHARS)

  def __init__(self):
    self._ids = {c: i + _FIRST_CHAR for i, c in enumerate(CHARS)}

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    """Text -> ids, optionally framed by BOS / EOS.

    Raises:
      ValueError: a character outside printable ASCII (naming it).
    """
    try:
      ids = [self._ids[c] for c in text]
    except KeyError as e:
      raise ValueError(f"CharTokenizer: character {e.args[0]!r} is not in the task alphabet") from None
    return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

  def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
    """Ids -> text. Stops at the first EOS (by default); skips PAD/BOS; ids past the alphabet
    (a model with a larger vocabulary may emit them) become U+FFFD so a checker rejects them."""
    out = []
    for i in ids:
      i = int(i)
      if i == EOS and stop_at_eos:
        break
      if i in (PAD, BOS, EOS):
        continue
      j = i - _FIRST_CHAR
      out.append(CHARS[j] if 0 <= j < len(CHARS) else "\ufffd")
    return "".join(out)
