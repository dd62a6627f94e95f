"""Name globs as other projects read them: the same glob as a regex, and whether two globs can
both match one name (what decides precedence when rules that merge become rules that compete).

``ParamKey.name`` globs match by :func:`fnmatch.fnmatchcase` (``*`` crosses dots); the regexes
here are built by :func:`fnmatch.translate`, the translation ``fnmatchcase`` itself uses, so a
glob and its regex select exactly the same names.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from functools import cache

__all__ = ["glob_regex", "globs_may_overlap"]


def glob_regex(include: Sequence[str], exclude: Sequence[str] = ()) -> str:
    """A regex that ``re.search`` finds in a name exactly when some ``include`` glob matches the
    whole name and no ``exclude`` glob does (torchtitan searches its patterns).

    Example:
        >>> pattern = glob_regex(["*.bias", "norm.weight"], exclude=["*.q_norm.*"])
        >>> [bool(re.search(pattern, n)) for n in ("fc.bias", "x.q_norm.bias", "norm.weight", "fc.weight")]
        [True, False, True, False]
    """
    if not include:
        raise ValueError("`include`: a regex needs at least one glob; got []; expected e.g. ['*.bias']")
    # fnmatch.translate gives "(?s:...)\\Z"; \A anchors the start as fnmatchcase's re.match does.
    excluded = f"(?!{'|'.join(fnmatch.translate(glob) for glob in exclude)})" if exclude else ""
    return rf"\A{excluded}(?:{'|'.join(fnmatch.translate(glob) for glob in include)})"


# A glob is a sequence of tokens: "*" (any run, even empty) or a one-character class, kept as
# ("lit", c), ("any", "?") or ("set", "[...]") (tested by fnmatch's own translation of it).
_Token = tuple[str, str]


def _tokens(glob: str) -> tuple[_Token, ...]:
    """The tokens of ``glob``, split as :func:`fnmatch.translate` splits it."""
    tokens: list[_Token] = []
    i, n = 0, len(glob)
    while i < n:
        c = glob[i]
        i += 1
        if c == "*":
            if not tokens or tokens[-1] != ("star", "*"):  # consecutive stars are one
                tokens.append(("star", "*"))
        elif c == "?":
            tokens.append(("any", "?"))
        elif c == "[":
            j = i
            if j < n and glob[j] == "!":
                j += 1
            if j < n and glob[j] == "]":
                j += 1
            while j < n and glob[j] != "]":
                j += 1
            if j >= n:  # no closing bracket: a literal "[", as fnmatch reads it
                tokens.append(("lit", "["))
            else:
                tokens.append(("set", glob[i - 1 : j + 1]))
                i = j + 1
        else:
            tokens.append(("lit", c))
    return tuple(tokens)


@cache
def _set_regex(text: str) -> re.Pattern[str]:
    return re.compile(fnmatch.translate(text))


def _one_char_overlap(a: _Token, b: _Token) -> bool:
    """Whether some single character matches both tokens; ``True`` when unsure (two sets)."""
    if a[0] == "lit" and b[0] == "lit":
        return a[1] == b[1]
    if a[0] == "lit" and b[0] == "set":
        return bool(_set_regex(b[1]).match(a[1]))
    if a[0] == "set" and b[0] == "lit":
        return bool(_set_regex(a[1]).match(b[1]))
    return True  # "?" takes any character; two sets are assumed to share one (refusing is safe)


def globs_may_overlap(a: str, b: str) -> bool:
    """Whether some name may match both globs: ``False`` only when none can.

    Exact except between two ``[...]`` sets, which count as sharing a character.

    Example:
        >>> globs_may_overlap("*.weight", "*norm*"), globs_may_overlap("*.weight", "*.bias")
        (True, False)
    """
    ta, tb = _tokens(a), _tokens(b)
    # Walk both globs at once: a state (i, j) means some prefix matches ta[:i] and tb[:j].
    seen = {(0, 0)}
    stack = [(0, 0)]
    while stack:
        i, j = stack.pop()
        if i == len(ta) and j == len(tb):
            return True
        moves = []
        star_a = i < len(ta) and ta[i][0] == "star"
        star_b = j < len(tb) and tb[j][0] == "star"
        if star_a:
            moves.append((i + 1, j))  # the star ends here
            if j < len(tb) and not star_b:
                moves.append((i, j + 1))  # the star takes b's next character
        if star_b:
            moves.append((i, j + 1))
            if i < len(ta) and not star_a:
                moves.append((i + 1, j))
        if i < len(ta) and j < len(tb) and not star_a and not star_b and _one_char_overlap(ta[i], tb[j]):
            moves.append((i + 1, j + 1))
        for move in moves:
            if move not in seen:
                seen.add(move)
                stack.append(move)
    return False
