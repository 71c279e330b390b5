"""Synthetic tasks a tiny random-init model can learn on CPU in minutes.

``echo``: the prompt shows a few words after "echo:"; the response must start with the first of
them. With ``k`` candidate words a random policy scores about 1/k.
"""
from __future__ import annotations

import random

ECHO_SOURCE = "synthetic/echo"


def make_echo_rows(n: int, words: list[str], seed: int, n_shown: int = 3) -> list[dict]:
    """Rows in verl's schema (prompt as chat messages, reward_model.ground_truth)."""
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        shown = [rnd.choice(words) for _ in range(n_shown)]
        rows.append({
            "data_source": ECHO_SOURCE,
            "prompt": [{"role": "user", "content": "echo: " + " ".join(shown)}],
            "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": shown[0]},
            "extra_info": {"index": i},
        })
    return rows


def echo_score(solution: str, ground_truth: str) -> float:
    words = solution.split()
    return 1.0 if words and words[0] == ground_truth else 0.0
