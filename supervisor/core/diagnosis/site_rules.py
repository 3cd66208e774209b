"""A site's own words (issue 23): what ``[[diagnosis.rule]]`` may say, and the rule the report
offers for a crash it could not name.

A site rule's ``match`` is a regex searched (case ignored) in every line of a crash, before
anything else reads it, inside the daemon, on a line of up to ``LINE_CHARS`` characters. A
regex that backtracks without bound would hang the crash reading (Python's ``re`` has no
time limit), so ``pattern_problem`` refuses, besides a pattern that does not compile or is
longer than ``MAX_PATTERN_CHARS``:

- **nested quantifiers**: a repeat whose body holds a repeat of variable length, such as
  ``(a+)+``, ``(a*)*``, ``(.*)*`` or ``(\\w+\\s?)+``: the text can be split between the two
  in exponentially many ways, and every one is tried before the search gives up;
- **a repeated alternation whose branches overlap**: ``(a|ab)+``, ``(\\w|\\d)+``; the same;
- **wildcards that multiply**: ``.*b.*c`` on a line of 4,000 ``b`` takes minutes (measured:
  177 s), because each split of the first ``.*`` retries the whole rest. ``_cost`` estimates
  the splits tried from one start position (a repeat whose characters cannot start what
  follows it adds its range; one whose characters can multiplies the rest by it) and
  refuses more than ``COST_BUDGET``: one unbounded ``.*`` passes, two do not, a bounded
  ``.{1,80}`` or a narrower class (``[^,]*``) does;
- a pattern that matches the empty string: it matches every line, so every crash would be
  read as its cause.

``rule_pattern`` turns a crash's ``unrecognised`` line (normalised by
``catalogue.normalise``) into such a regex: the literal text escaped, runs of white space as
``\\s+``, each placeholder (``<n>``, ``<size>``, ``<path>``, ``<hex>``, ``<id>``, ``<*>``) as a
bounded class that covers what the normaliser replaced, cut to ``MAX_PATTERN_CHARS`` and to
what ``pattern_problem`` accepts (a search is not anchored: a shorter prefix still matches).
``rule_toml`` wraps it as a ``[[diagnosis.rule]]`` table to paste into the config.

Pure: no I/O; ``re``'s own parser (``re._parser``, the tree ``re.compile`` builds from) reads
the pattern's structure.
"""

from __future__ import annotations

import importlib
import re
import warnings
from collections.abc import Sequence
from typing import Any

from supervisor.core.model import LOG_CAUSES, Cause

MAX_PATTERN_CHARS = 300
LINE_CHARS = 4096  # diagnosis.MAX_LINE_CHARS: the longest line a rule is searched in
COST_BUDGET = 20_000  # ways tried from one start position (one unbounded ".*": 4,096)

# Causes a site rule may name: those a log can name (model.LOG_CAUSES). The daemon's own
# (hang, headroom_low, gpu_memory_stuck, startup_timeout, preflight_failed, operator_restart)
# are what it observes itself, never words in a log.
SITE_CAUSES: tuple[Cause, ...] = LOG_CAUSES

_parser: Any = importlib.import_module("re._parser")  # re.compile's own parser (3.11+)


# --------------------------------------------------------------------------- character sets
#
# A character class is approximated by the sample characters it holds: all of Latin-1 and a
# few others (a letter, a digit and two spaces outside it). Two classes "overlap" when they
# share a sample; an approximation can only miss an overlap in exotic characters.

_ALPHABET: tuple[str, ...] = (*(chr(i) for i in range(256)), "ā", "ß", "Ω", "中", "٣", "\u2028", "\u3000", "😀")
_ALL = frozenset(_ALPHABET)
_EMPTY: frozenset[str] = frozenset()
_CATEGORY_PROBES = {
    "CATEGORY_DIGIT": r"\d", "CATEGORY_NOT_DIGIT": r"\D", "CATEGORY_SPACE": r"\s",
    "CATEGORY_NOT_SPACE": r"\S", "CATEGORY_WORD": r"\w", "CATEGORY_NOT_WORD": r"\W",
}


def _name(op: object) -> str:
    return str(getattr(op, "name", op))


def _category(code: object) -> frozenset[str]:
    probe = _CATEGORY_PROBES.get(_name(code))
    if probe is None:  # a line-break category or one unknown here: anything
        return _ALL
    rx = re.compile(probe)
    return frozenset(c for c in _ALPHABET if rx.fullmatch(c))


def _variants(c: str) -> set[str]:
    """``c`` and its other cases: a site rule is searched with case ignored."""
    return {v for v in (c, c.lower(), c.upper(), c.swapcase()) if len(v) == 1}


def _literal(code: int) -> frozenset[str]:
    return frozenset(_variants(chr(code)))


def _in_class(items: Sequence[tuple[Any, Any]]) -> frozenset[str]:
    chosen: set[str] = set()
    negate = False
    for op, av in items:
        name = _name(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            chosen |= _literal(av)
        elif name == "RANGE":
            lo, hi = av
            chosen |= {c for c in _ALPHABET if any(lo <= ord(v) <= hi for v in _variants(c))}
        elif name == "CATEGORY":
            chosen |= _category(av)
        else:  # anything unforeseen: assume it may match anything
            chosen |= _ALL
    if negate:  # over-approximated: a negated class keeps the case variants of what it names
        return frozenset(c for c in _ALPHABET if not (_variants(c) <= chosen))
    return frozenset(chosen)


def _single(name: str, av: Any) -> frozenset[str] | None:
    """The characters a one-character item matches; None for any other item."""
    if name == "LITERAL":
        return _literal(av)
    if name == "NOT_LITERAL":
        return _ALL - {chr(av)}
    if name == "ANY":
        return _ALL
    if name == "IN":
        return _in_class(av)
    if name == "CATEGORY":
        return _category(av)
    return None


# --------------------------------------------------------------------------- the tree

Item = tuple[str, Any]


def _items(sub: Any) -> list[Item]:
    """A (sub)pattern's items as (opcode name, argument)."""
    return [(_name(op), av) for op, av in getattr(sub, "data", sub)]


def _children(name: str, av: Any) -> list[list[Item]]:
    """The sub-sequences an item holds (a group's body, each branch, a repeat's body...)."""
    if name == "SUBPATTERN":
        return [_items(av[3])]
    if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        return [_items(av[2])]
    if name == "BRANCH":
        return [_items(b) for b in av[1]]
    if name == "ATOMIC_GROUP":
        return [_items(av)]
    if name in ("ASSERT", "ASSERT_NOT"):
        return [_items(av[1])]
    if name == "GROUPREF_EXISTS":
        return [_items(b) for b in av[1:] if b is not None]
    return []


def _first(seq: Sequence[Item]) -> tuple[frozenset[str], bool]:
    """(the characters ``seq`` can start with, whether it can match the empty string)."""
    out: set[str] = set()
    for name, av in seq:
        chars, nullable = _item_first(name, av)
        out |= chars
        if not nullable:
            return frozenset(out), False
    return frozenset(out), True


def _item_first(name: str, av: Any) -> tuple[frozenset[str], bool]:
    single = _single(name, av)
    if single is not None:
        return single, False
    if name in ("AT", "ASSERT", "ASSERT_NOT"):  # zero width
        return _EMPTY, True
    if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        chars, nullable = _first(_items(av[2]))
        return chars, nullable or av[0] == 0
    if name in ("SUBPATTERN", "ATOMIC_GROUP", "BRANCH", "GROUPREF_EXISTS"):
        branches = [_first(b) for b in _children(name, av)]
        nullable = any(n for _, n in branches) or (name == "GROUPREF_EXISTS" and av[2] is None)
        return frozenset().union(*(c for c, _ in branches)), nullable
    return _ALL, True  # a back-reference, or anything unforeseen


def _is_repeat(name: str) -> bool:
    return name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")


def _holds_variable_repeat(seq: Sequence[Item]) -> bool:
    for name, av in seq:
        if _is_repeat(name) and av[0] != av[1]:
            return True
        if any(_holds_variable_repeat(child) for child in _children(name, av)):
            return True
    return False


def _overlapping_branches(seq: Sequence[Item]) -> bool:
    """Whether an alternation in ``seq`` has two branches that can start alike (or one that
    can match nothing): repeated, the same text has many ways through it."""
    for name, av in seq:
        if name == "BRANCH":
            firsts = [_first(_items(b)) for b in av[1]]
            if any(nullable for _, nullable in firsts):
                return True
            for i, (a, _) in enumerate(firsts):
                if any(a & b for b, _ in firsts[i + 1:]):
                    return True
        if any(_overlapping_branches(child) for child in _children(name, av)):
            return True
    return False


def _structure_problem(seq: Sequence[Item]) -> str | None:
    """Exponential backtracking: a repeat (more than once) of something ambiguous."""
    for name, av in seq:
        if _is_repeat(name) and av[1] > 1:
            body = _items(av[2])
            if _holds_variable_repeat(body):
                return "nested quantifiers can backtrack without bound"
            if _overlapping_branches(body):
                return "a repeated alternation whose branches can match the same text can backtrack without bound"
        for child in _children(name, av):
            if (problem := _structure_problem(child)) is not None:
                return problem
    return None


def _cost(seq: Sequence[Item], after: frozenset[str], after_cost: float) -> float:
    """How many ways a search may take from one start position, at worst, through ``seq``
    followed by something that starts with ``after`` and has ``after_cost`` ways; each way
    costs at most a line's length in steps.

    Read right to left. One character (or an anchor) adds no way of its own. A repeat with
    ``w`` possible counts whose characters can start what follows offers ``w`` places where
    what follows is tried (``w`` x rest); one whose characters cannot offers one (the other
    counts fail on the next character). An alternation tries each branch."""
    cost = after_cost
    for name, av in reversed(seq):
        cost = min(_item_cost(name, av, after, cost), 1e18)
        chars, nullable = _item_first(name, av)
        after = chars | after if nullable else chars
    return cost


def _search_cost(seq: Sequence[Item]) -> float:
    """``_cost`` of a whole pattern. Its tail that cannot fail (a repeat that may match
    nothing, ``.*$``) is reached once, when the match succeeds: it multiplies nothing, so
    ``.*Custom.*`` costs what ``.*Custom`` costs."""
    items = list(seq)
    while items:
        name, av = items[-1]
        if _is_repeat(name) and av[0] == 0:
            items.pop()
        elif (name == "AT" and _name(av) in ("AT_END", "AT_END_STRING") and len(items) > 1
              and _name(items[-2][0]) == "MAX_REPEAT" and items[-2][1][0] == 0 and items[-2][1][1] >= LINE_CHARS
              and _items(items[-2][1][2]) and _items(items[-2][1][2])[0][0] == "ANY"):
            del items[-2:]  # ".*$": the dot runs to the end of the line, where "$" holds
        else:
            break
    return _cost(items, _EMPTY, 1.0)


def _item_cost(name: str, av: Any, after: frozenset[str], after_cost: float) -> float:
    if _is_repeat(name):
        low, high, body = av[0], min(av[1], LINE_CHARS), _items(av[2])
        chars, _ = _first(body)
        per_round = _cost(body, chars | after, 1.0)
        ways = high - low + 1 if high > low and chars & after else 1
        return ways * per_round * after_cost
    if name in ("BRANCH", "GROUPREF_EXISTS"):
        return sum(_cost(b, after, after_cost) for b in _children(name, av)) + (
            after_cost if name == "GROUPREF_EXISTS" and av[2] is None else 0.0)
    if name in ("SUBPATTERN", "ATOMIC_GROUP"):
        return _cost(_children(name, av)[0], after, after_cost)
    if name in ("ASSERT", "ASSERT_NOT"):
        return _cost(_children(name, av)[0], _EMPTY, 1.0) + after_cost
    return after_cost


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot be a site rule's ``match`` (one phrase), or None when it can."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"{len(pattern)} characters: at most {MAX_PATTERN_CHARS}"
    try:
        with warnings.catch_warnings():  # "possible nested set": a line on stderr would break check-config's one
            warnings.simplefilter("ignore")
            rx = re.compile(pattern, re.IGNORECASE)
            tree = _items(_parser.parse(pattern, re.IGNORECASE))
    except (re.error, RecursionError, OverflowError, ValueError) as exc:
        return f"not a valid regex: {str(exc)[:120]}"
    if (problem := _structure_problem(tree)) is not None:
        return problem
    if _search_cost(tree) > COST_BUDGET:
        return ("wildcards that can match the same text (such as '.*' twice) can backtrack for minutes on one long "
                "line; bound them ('.{0,80}') or narrow them ('[^,]*')")
    if rx.search("") is not None:
        return "matches an empty line, so every crash would be read as its cause"
    return None


# --------------------------------------------------------------------------- the offered rule

# Each placeholder of catalogue.normalise as a bounded class that covers what it replaced.
WILDCARDS: dict[str, str] = {
    "<n>": r"[\d.eE+-]{1,48}",  # 12, -3, 0.82, 1e-05
    "<size>": r"[\d.]{1,34} ?[A-Za-z]{1,5}",  # 2.00 GiB, 839.72 MiB, 1024 bytes
    "<hex>": r"[0-9a-fA-FxX]{1,66}",  # 0x7f3a..., a digest
    "<id>": r"[0-9A-Fa-f-]{36}",  # a uuid
    "<path>": r"[\w.@+=:~/-]{1,1000}",  # /models/kimi/config.json
    "<*>": r".{0,240}?",  # a literal "<*>" in the line
}
_TOKEN = re.compile(r"<(?:\*|n|size|path|hex|id)>")
_LOG_PREFIX = re.compile(r"^(?:\s*\[[^\]]{0,100}\]:?)+\s*")  # "[<n>-<n>-<n> <n>:<n>:<n> TP0] "
_PARTIAL_TOKEN = re.compile(r"<[a-z*]{0,4}$")  # a placeholder cut in half at the end


def _literal_atoms(text: str) -> list[str]:
    atoms: list[str] = []
    for part in re.split(r"(\s+)", text):
        if not part:
            continue
        if part.isspace():
            atoms.append(r"\s+")
            continue
        for c in part:
            if c == "'":  # the rule is pasted as a TOML literal string, which cannot hold one
                atoms.append(r"\x27")
            elif not c.isprintable():
                atoms.append(f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}" if ord(c) < 0x10000
                             else f"\\U{ord(c):08x}")
            else:
                atoms.append(re.escape(c))
    return atoms


def _atoms(normalised: str) -> list[tuple[str, bool]]:
    """(regex fragment, is it literal text) for each character, space run or placeholder."""
    text = _LOG_PREFIX.sub("", normalised.strip())
    text = _PARTIAL_TOKEN.sub("", text)
    out: list[tuple[str, bool]] = []
    pos = 0
    for m in _TOKEN.finditer(text):
        out += [(a, True) for a in _literal_atoms(text[pos:m.start()])]
        out.append((WILDCARDS[m.group()], False))
        pos = m.end()
    out += [(a, True) for a in _literal_atoms(text[pos:])]
    return out


def _literal_letters(atoms: Sequence[tuple[str, bool]]) -> int:
    return sum(1 for a, literal in atoms if literal and a[-1:].isalpha() and not a.startswith("\\"))


def rule_pattern(normalised: str) -> str | None:
    """A regex for a site rule that matches the line ``normalised`` came from (``normalise``
    of it), bounded and accepted by ``pattern_problem``; None when too little of the line is
    literal text (fewer than 4 letters) to make a rule of."""
    atoms = _atoms(normalised)
    kept: list[tuple[str, bool]] = []
    length = 0
    for atom in atoms:
        if length + len(atom[0]) > MAX_PATTERN_CHARS:
            break
        kept.append(atom)
        length += len(atom[0])
    while kept:
        while kept and (not kept[-1][1] or kept[-1][0] == r"\s+"):  # nothing to gain at the end
            kept.pop()
        pattern = "".join(a for a, _ in kept)
        if kept and pattern_problem(pattern) is None:
            break
        if kept:
            kept.pop()
    if _literal_letters(kept) < 4:
        return None
    return "".join(a for a, _ in kept)


def rule_toml(normalised: str, cause: str = "other") -> str | None:
    """The ``[[diagnosis.rule]]`` table to paste for the line ``normalised`` came from, or
    None when no rule can be made of it. ``cause`` is the reading the daemon settled on."""
    pattern = rule_pattern(normalised)
    if pattern is None:
        return None
    named = cause if cause in {str(c) for c in SITE_CAUSES} else "other"
    return (f"[[diagnosis.rule]]\n"
            f"match = '{pattern}'\n"
            f'cause = "{named}"   # set the cause you know it to be')
