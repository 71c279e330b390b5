"""MATH (Hendrycks) rule reward: the last \\boxed{...} (or \\fbox{...}) of the response, normalised,
compared with the ground truth normalised the same way."""
from __future__ import annotations

import re
from typing import Optional


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} / \\fbox{...} / "\\boxed x" in ``text`` (braces balanced)."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    if rest.startswith("\\boxed "):
        return rest[len("\\boxed "):].split("$")[0].strip()
    open_at = rest.find("{")
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[open_at + 1:i]
    return None


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i) and i + 5 < len(s) and s[i + 5] != "{":
            a = s[i + 5]
            rest = s[i + 6:]
            if rest.startswith("{"):
                out.append("\\frac{" + a + "}")
                i += 6
            elif rest:
                out.append("\\frac{" + a + "}{" + rest[0] + "}")
                i += 7
            else:
                out.append(s[i:])
                break
            continue
        out.append(s[i])
        i += 1
    return "".join(out)


def normalize(answer: str) -> str:
    s = answer.strip().replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    s = re.sub(r"\\mbox\{\s*([^}]*)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"(\s|^)\.(\d)", r"\g<1>0.\2", s)
    if s.startswith("."):
        s = "0" + s
    # "x = 5" -> "5" for short left-hand sides
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2:
        s = parts[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    s = re.sub(r"(\d)\.0+$", r"\1", s)  # 5.00 -> 5
    return s


def is_equiv(a: Optional[str], b: Optional[str]) -> bool:
    if a is None or b is None:
        return False
    return normalize(a) == normalize(b)


def compute_score(solution: str, ground_truth: str) -> float:
    """1 if the last boxed answer equals the ground truth after normalisation, else 0. The ground
    truth may itself be a full solution with a \\boxed{} answer."""
    gt = last_boxed(ground_truth) if "\\boxed" in ground_truth else ground_truth
    return 1.0 if is_equiv(last_boxed(solution), gt) else 0.0
