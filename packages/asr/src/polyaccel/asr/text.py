"""English transcript normalization for scoring, in the spirit of Whisper's evaluation
normalizer (a compact one written for this project): "Mr." and "mister", "21" and "twenty
one", "don't" and "do not", "colour" and "color" compare equal; punctuation, fillers and
bracketed annotations are dropped. :func:`wer` is the corpus word error rate after it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

_ABBREVIATIONS = {
    "mr": "mister", "mrs": "missus", "ms": "miss", "dr": "doctor", "prof": "professor",
    "st": "saint", "jr": "junior", "sr": "senior", "vs": "versus", "etc": "et cetera",
    "gov": "governor", "gen": "general", "capt": "captain", "lt": "lieutenant", "sgt": "sergeant",
    "col": "colonel", "rev": "reverend", "hon": "honorable", "messrs": "messieurs",
}
_CONTRACTIONS = [
    (re.compile(r"\bwon't\b"), "will not"), (re.compile(r"\bcan't\b"), "can not"),
    (re.compile(r"\bcannot\b"), "can not"), (re.compile(r"\bain't\b"), "is not"),
    (re.compile(r"\bshan't\b"), "shall not"), (re.compile(r"n't\b"), " not"),
    (re.compile(r"'re\b"), " are"), (re.compile(r"'ll\b"), " will"), (re.compile(r"'ve\b"), " have"),
    (re.compile(r"\bi'm\b"), "i am"), (re.compile(r"\blet's\b"), "let us"),
]
_SPELLING = {  # British -> American, the common ones
    "colour": "color", "favour": "favor", "honour": "honor", "labour": "labor", "neighbour": "neighbor",
    "behaviour": "behavior", "humour": "humor", "centre": "center", "theatre": "theater",
    "metre": "meter", "realise": "realize", "organise": "organize", "recognise": "recognize",
    "travelled": "traveled", "travelling": "traveling", "grey": "gray", "defence": "defense",
    "offence": "offense", "licence": "license", "programme": "program", "okay": "ok",
}
_FILLERS = frozenset({"uh", "um", "umm", "uhm", "hmm", "mm", "mhm", "er", "erm", "ah", "eh", "hm"})

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
         "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_SCALES = [(10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand")]
_ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth",
                  "eight": "eighth", "nine": "ninth", "twelve": "twelfth"}


def number_to_words(n: int) -> str:
    """Spell a non-negative integer in English words, without "and" (``105`` -> "one hundred five")."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + number_to_words(rest))
    for value, name in _SCALES:
        if n >= value:
            rest = n % value
            return number_to_words(n // value) + " " + name + ("" if rest == 0 else " " + number_to_words(rest))
    raise AssertionError("unreachable")


def _year_or_number(digits: str) -> str:
    n = int(digits)
    if len(digits) == 4 and 1100 <= n <= 1999 and n % 100 != 0:  # "1995" is read "nineteen ninety five"
        lo = n % 100
        return number_to_words(n // 100) + " " + (("oh " + _ONES[lo]) if lo < 10 else number_to_words(lo))
    if len(digits) == 4 and 1100 <= n <= 1999:
        return number_to_words(n // 100) + " hundred"
    return number_to_words(n)


def _ordinal(words: str) -> str:
    head, _, last = words.rpartition(" ")
    if last in _ORDINAL_WORDS:
        last = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return f"{head} {last}".strip()


_CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "\u00a3": ("pound", "pounds", "penny", "pence"),
               "\u20ac": ("euro", "euros", "cent", "cents")}
_MONEY = re.compile(r"([$\u00a3\u20ac])\s?(\d+)(?:\.(\d+))?(?:\s?(thousand|million|billion|trillion)\b)?")


def _money(m: re.Match[str]) -> str:
    """"$1.5 million" -> "1.5 million dollars", "$2.50" -> "2 dollars 50 cents", "$1" -> "1 dollar"."""
    one, many, sub_one, sub_many = _CURRENCIES[m[1]]
    whole, frac, scale = m[2], m[3], m[4]
    if scale:
        return f" {whole}{'.' + frac if frac else ''} {scale} {many} "
    if frac is not None and len(frac) != 2:
        return f" {whole}.{frac} {many} "
    main = f"{whole} {one if int(whole) == 1 else many}"
    if not frac or int(frac) == 0:
        return f" {main} "
    cents = f"{int(frac)} {sub_one if int(frac) == 1 else sub_many}"
    return f" {cents} " if int(whole) == 0 else f" {main} {cents} "


def _plural(words: str) -> str:
    """"nineteen ninety" -> "nineteen nineties" (the 1990s), "six" -> "sixes"."""
    head, _, last = words.rpartition(" ")
    last = last[:-1] + "ies" if last.endswith("y") else last + ("es" if last.endswith("x") else "s")
    return f"{head} {last}".strip()


def _spell_numbers(text: str) -> str:
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,000 -> 1000
    text = _MONEY.sub(_money, text)
    text = re.sub(r"(\d)\s?%", r"\1 percent", text)
    text = re.sub(r"\b(\d+)(st|nd|rd|th)\b", lambda m: " " + _ordinal(number_to_words(int(m[1]))) + " ", text)
    text = re.sub(r"\b(\d+)s\b", lambda m: " " + _plural(_year_or_number(m[1])) + " ", text)  # the 1990s
    text = re.sub(r"\b(\d+)\.(\d+)\b", lambda m: f" {_year_or_number(m[1])} point " + " ".join(_ONES[int(d)] for d in m[2]) + " ", text)
    return re.sub(r"\d+", lambda m: " " + _year_or_number(m[0]) + " ", text)


def normalize_text(text: str) -> str:
    """Normalize English text for WER: lowercase words separated by single spaces, no
    punctuation, numbers spelled out, abbreviations and contractions expanded, fillers and
    bracketed annotations (``[noise]``, ``(laughs)``, ``<unk>``) removed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = text.replace("\u2019", "'").replace("\u2018", "'")
    text = re.sub(r"\[[^\]]*\]|\([^)]*\)|<[^>]*>", " ", text)
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    text = re.sub(r"\b(" + "|".join(_ABBREVIATIONS) + r")\b\.?", lambda m: _ABBREVIATIONS[m[1]], text)
    for pattern, repl in _CONTRACTIONS:
        text = pattern.sub(repl, text)
    text = text.replace("&", " and ").replace("+", " plus ").replace("@", " at ")
    text = _spell_numbers(text)
    text = re.sub(r"[^\w\s']|_", " ", text)           # punctuation (hyphens too) -> space
    text = re.sub(r"(?<!\w)'|'(?!\w)", " ", text)      # quotes, not apostrophes inside words
    words = [_SPELLING.get(w, w) for w in text.split() if w not in _FILLERS]
    return " ".join(words)


def wer(refs: Sequence[str], hyps: Sequence[str]) -> float:
    """Corpus word error rate of ``hyps`` against ``refs`` after :func:`normalize_text`.

    Raises ValueError when the lists differ in length or every reference is empty."""
    from polyaccel.asr.wer import wer_counts

    if refs and not any(normalize_text(r) for r in refs):
        raise ValueError("all references are empty after normalization")
    return wer_counts(refs, hyps).wer
