"""Pull the final answer out of a response: the last ``\\boxed{...}``, the last fenced code block."""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; ``\\boxed 5`` too.

    Escaped braces (``\\{``, ``\\}``) do not count. Returns None when there is no box or the last one
    is unbalanced (a truncated response has no final answer).
    """
    start = max(text.rfind(c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] != "{" and not text[i].isspace():
        return None  # e.g. \boxedsomething: another command
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # "\boxed 5": up to the next space or dollar sign
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


def last_code_block(text: str, languages: tuple[str, ...] = ("python", "py", "python3")) -> str | None:
    """The last fenced block tagged with one of ``languages``, else the last untagged one, else None."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for wanted in (set(languages), {""}):
        tagged = [code for lang, code in blocks if lang in wanted]
        if tagged:
            return tagged[-1]
    return None
