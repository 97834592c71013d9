"""A character tokenizer whose vocabulary is saved beside the model (``tokenizer.json``).

ConformerAED has no public weights, so it needs no SentencePiece model: one id per special
token, then one id per character. Ids past the vocabulary (a model's embedding may be
larger, e.g. 5248 rows in the canary-shaped presets) decode to nothing.

``tokenizer.json`` format (ours, not Hugging Face tokenizers')::

    {"type": "char", "special_tokens": ["<pad>", "<bos>", "<eos>", "<unk>"],
     "characters": " abc...", "unk_token": "<unk>"}
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

DEFAULT_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_CHARACTERS = " abcdefghijklmnopqrstuvwxyz0123456789'.,?!-"


class CharTokenizer:
    """Maps text to one id per character and back; specials first (pad 0, bos 1, eos 2, unk 3)."""

    def __init__(self, characters: str = DEFAULT_CHARACTERS,
                 special_tokens: Iterable[str] = DEFAULT_SPECIAL_TOKENS, unk_token: str = "<unk>",
                 lowercase: bool = True) -> None:
        self.special_tokens = list(special_tokens)
        if len(set(characters)) != len(characters):
            raise ValueError("characters must be unique")
        if unk_token not in self.special_tokens:
            raise ValueError(f"unk_token {unk_token!r} must be one of the special tokens")
        self.characters = characters
        self.unk_token = unk_token
        self.lowercase = lowercase
        self._char_to_id = {c: i + len(self.special_tokens) for i, c in enumerate(characters)}
        self._id_to_piece = self.special_tokens + list(characters)

    def __len__(self) -> int:
        return len(self._id_to_piece)

    def token_id(self, token: str) -> int:
        """The id of a special token such as ``"<eos>"``."""
        return self.special_tokens.index(token)

    def encode(self, text: str) -> list[int]:
        """Text -> ids (no bos/eos added); unknown characters become ``unk_token``."""
        unk = self.token_id(self.unk_token)
        if self.lowercase:
            text = text.lower()
        return [self._char_to_id.get(c, unk) for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; special tokens and ids outside the vocabulary are dropped."""
        n_special = len(self.special_tokens)
        return "".join(self._id_to_piece[i] for i in map(int, ids) if n_special <= i < len(self))

    # ---- persistence -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        return {"type": "char", "special_tokens": self.special_tokens, "characters": self.characters,
                "unk_token": self.unk_token, "lowercase": self.lowercase}

    def save(self, directory: str | os.PathLike[str]) -> None:
        with open(os.path.join(directory, "tokenizer.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2, ensure_ascii=False)
            f.write("\n")

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> CharTokenizer:
        from polyaccel.asr.config_limits import read_json_object

        path = os.path.join(directory, "tokenizer.json")
        d = read_json_object(path)
        if d.get("type") != "char":
            raise ValueError(f"not a character tokenizer: type={d.get('type')!r}")
        fields = {"characters": (d.get("characters"), "a string"),
                  "special_tokens": (d.get("special_tokens"), "a list of strings"),
                  "unk_token": (d.get("unk_token"), "a string"), "lowercase": (d.get("lowercase", True), "true or false")}
        for name, (value, want) in fields.items():
            ok = (isinstance(value, list) and all(isinstance(t, str) for t in value) if name == "special_tokens"
                  else isinstance(value, bool if name == "lowercase" else str))
            if not ok:
                text = repr(value)
                raise ValueError(f"{path}: {name}={text if len(text) <= 60 else text[:57] + '...'} is not {want}")
        try:
            return cls(d["characters"], d["special_tokens"], d["unk_token"], d.get("lowercase", True))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
