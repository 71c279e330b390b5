"""GSM8K rule reward: verl's extraction (verl/utils/reward_score/gsm8k.py, v0.9.0), compared as
numbers where verl compares strings ("18.00" against "18" is right here, wrong in verl).

``strict``: the answer is the number after "#### " (commas and "$" dropped).
``flexible``: the last number in the response (here also without commas and a trailing ".").
Only the last 300 characters are searched (long reasoning before the answer is irrelevant and
regexes over it are slow).
"""
from __future__ import annotations

import re
from typing import Optional

_CLIP = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_answer(solution: str, method: str = "strict") -> Optional[str]:
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k: method must be 'strict' or 'flexible', got {method!r}")
    text = solution[-_CLIP:]
    if method == "strict":
        m = _STRICT.findall(text)
        return m[-1].replace(",", "").replace("$", "") if m else None
    for cand in reversed(_NUMBER.findall(text)):
        if cand not in ("", "."):
            return cand.replace(",", "").rstrip(".")
    return None


def _same_number(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def compute_score(solution: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong one that was found, 0 if none."""
    answer = extract_answer(solution, method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, str(ground_truth).replace(",", "").strip()) else format_score
