"""What the catalogue harvester reads out of one source (scripts/catalogue/harvest.py runs it).

Everything that decides a source's harvest lives here, so that the cache of harvested sources
(``CACHE/../harvested/DIST-VERSION-HASH.json``) is keyed by this file, the normaliser of
``supervisor/core/diagnosis/catalogue.py`` and the source's entry in ``sources.toml``: a change
to the merge or to the families (``harvest.py``, ``families.py``) re-merges in seconds, a change
here harvests again.

* Python sources (``ast``, never regex): ``raise X(msg)`` and every ``SomethingError(msg)`` built
  elsewhere (``return RuntimeError(...)``), ``logger.<level>(msg, *args)`` (any receiver whose
  name ends in ``logger``/``log``, and ``logging``; vLLM's ``*_once`` too), ``warnings.warn(msg)``,
  ``assert cond, msg``, ``print(..., file=sys.stderr)``, ``sys.exit(msg)`` and argparse's
  ``self.error(msg)``. A message is its literal text with each formatted value (an f-string
  field, a ``%s``-style conversion, a ``str.format`` field, a non-literal operand of ``+``) as
  ``<*>``; a name bound to a string in the same function (``msg = "..."; raise X(msg)``) or at
  module level is followed; ``"a" if c else "b"`` gives both.
* Shared libraries: printable runs that read like messages (``human``), and error-string
  tables (``cudaGetErrorString``, ``ncclGetErrorString``) bounded by their first and last strings.
* C sources (Triton's driver): string literals that report a failure.
* The running interpreter's standard library and ``os.strerror`` of every errno.

A message becomes a pattern with ``to_pattern``: ``catalogue.normalise`` over the whole text,
then whatever the normaliser would fold together with a value in a real line (a unit after it,
a path or ``0x`` around it) folded into its ``<*>``, so a pattern matches the normalised line.
"""

from __future__ import annotations

import ast
import errno
import os
import re
import signal
import string
import sys
import sysconfig
import time
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from supervisor.core.diagnosis import catalogue as cat

MARK = "\ue000"  # a formatted value while a message is being built; <*> in the pattern

LEVELS = {"debug": "debug", "info": "info", "warning": "warning", "warn": "warning", "error": "error",
          "exception": "error", "critical": "critical", "fatal": "critical"}
EXC_NAME = re.compile(r"^_?[A-Z]\w*(?:Error|Exception|Exit|Failure|Fault|Interrupt)$")
MAX_ALTERNATIVES = 4
MAX_PATTERN = 600  # characters; a longer message is cut (a log line holds its start)


def log(msg: str) -> None:
    print(f"harvest: {msg}", file=sys.stderr, flush=True)


# =========================================================================== patterns

_PERCENT = re.compile(r"%(?:\([^)]{0,40}\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlLqjzt]{0,2}[diouxXeEfFgGcrsabp%]")
_UNIT_AFTER = re.compile(MARK + r" ?(?:[KMGTP]i?B|bytes?)\b", re.IGNORECASE)
_PATHISH = re.compile(r"[~\w.@+=:/\-" + MARK + r"]+")
_HEX_BEFORE = re.compile(r"0x" + MARK)
_MARKS = re.compile(MARK + r"{2,}")
_QUOTE_AFTER_LAST = re.compile(MARK + r"['\"`]{1,3}$")


def percent(text: str) -> str:
    """``%s``-style conversions as MARK, ``%%`` as ``%``."""
    return _PERCENT.sub(lambda m: "%" if m.group() == "%%" else MARK, text)


def braces(text: str) -> str:
    """``str.format`` fields as MARK, ``{{``/``}}`` as braces (left alone when malformed)."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError:
        return text
    out = []
    for literal, field, _spec, _conv in parsed:
        out.append(literal)
        if field is not None:
            out.append(MARK)
    return "".join(out)


def to_pattern(text: str) -> str:
    """A message with MARKs -> a catalogue pattern: the normaliser over the whole text, then
    whatever the normaliser would fold together with a value in a real line (a unit after it,
    a path or a ``0x`` around it) folded into its ``<*>``, runs of ``<*>`` as one."""
    text = text.replace("\t", " ").replace("\r", " ").replace("\n", " ")
    text = cat.normalise(text)
    text = _UNIT_AFTER.sub(MARK, text)
    text = _HEX_BEFORE.sub(MARK, text)
    text = _PATHISH.sub(lambda m: MARK if MARK in m.group() and "/" in m.group() else m.group(), text)
    text = _MARKS.sub(MARK, text)
    text = _QUOTE_AFTER_LAST.sub(MARK, text)  # "Cuda failure '<*>'": a wrapper ends in its <*>
    text = text.replace(MARK, cat.ANY)
    if len(text) > MAX_PATTERN:
        cut = text[:MAX_PATTERN]
        if cut.rfind("<") > cut.rfind(">"):  # never cut a placeholder in two
            cut = cut[: cut.rfind("<")]
        text = cut.rstrip()
    return text


# A wrapper: a short label of a CUDA/NCCL/Triton error around the error itself ("CUDA error: <*>",
# "Cuda failure '<*>'", "NCCL error in: <*>"). Its few letters are kept all the same: the diagnosis
# reads the text its <*> held against the error tables (catalogue.Match.inner).
WRAPPER = re.compile(r"^(?:CUDA|Cuda|cuda|NCCL|nccl|Triton|cuDNN|CUDNN|cuBLAS|CUBLAS|HIP|hip|NVRTC|nvrtc|CUresult)"
                     r"[\w ]{0,20}\b(?:error|Error|ERROR|failure|Failure)\b[^<>]{0,12}<\*>\W{0,3}$")


def wrapper(marked: str) -> bool:
    """Whether a message (with MARKs) is a wrapper (cheap checks first: most strings are not)."""
    return len(marked) < 80 and marked.rstrip("'\"` ").endswith(MARK) and bool(WRAPPER.match(to_pattern(marked)))


def keepable(pattern: str, level: str) -> bool:
    """Enough literal text to match on: MIN_LITERAL_CHARS letters, except an error table's rows
    (two words at least, or an enum name) and a wrapper."""
    if level == "table":
        return len(re.findall(r"[A-Za-z]{2,}", pattern)) >= 2 or bool(re.fullmatch(r"[a-z]+[A-Z]\w{6,}", pattern))
    return cat.literal_chars(pattern) >= cat.MIN_LITERAL_CHARS or bool(WRAPPER.match(pattern))


# =========================================================================== Python sources


def _callee(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _receiver(func: ast.expr) -> str:
    """``logger`` of ``self.logger.error``: the name the method is called on."""
    if isinstance(func, ast.Attribute):
        value = func.value
        if isinstance(value, ast.Name):
            return value.id
        if isinstance(value, ast.Attribute):
            return value.attr
    return ""


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _assignments(body: list[ast.stmt]) -> dict[str, list[tuple[int, ast.expr, bool]]]:
    """Names bound in a scope's own statements (not in nested functions or classes):
    name -> [(line, value, augmented)]."""
    found: dict[str, list[tuple[int, ast.expr, bool]]] = {}
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found.setdefault(node.targets[0].id, []).append((node.lineno, node.value, False))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found.setdefault(node.target.id, []).append((node.lineno, node.value, False))
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and isinstance(node.op, ast.Add):
            found.setdefault(node.target.id, []).append((node.lineno, node.value, True))
        stack.extend(ast.iter_child_nodes(node))
    for v in found.values():
        v.sort(key=lambda t: t[0])
    return found


class PyHarvester(ast.NodeVisitor):
    """The messages of one module."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.entries: list[dict[str, Any]] = []
        self.scopes: list[dict[str, list[tuple[int, ast.expr, bool]]]] = []
        self.depth = 0
        self.exc_class: str | None = None  # inside an exception class: its message is built here
        self.method: str = ""
        self.caught: list[str] = []  # the names of the exceptions being handled (``except X as e``)
        self.functions: list[str] = []  # the functions the visit is in (the innermost names the phase)
        self.wraps = False  # the message being rendered formats a caught exception into itself

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        self.caught.append(node.name or "")
        self.generic_visit(node)
        self.caught.pop()

    # ---- an exception class that builds its own message (Triton's OutOfResources: "out of
    # resource: {name}, Required: ..." in __init__, not at the raise)
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [_dotted(b).rsplit(".", 1)[-1] for b in node.bases]
        is_exc = bool(EXC_NAME.match(node.name)) or any(b and EXC_NAME.match(b) for b in bases)
        outer, self.exc_class = self.exc_class, node.name if is_exc else None
        self.generic_visit(node)
        self.exc_class = outer

    def visit_Assign(self, node: ast.Assign) -> None:
        if self.exc_class and any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                  and t.value.id == "self" and t.attr in ("message", "msg", "_message")
                                  for t in node.targets):
            self.add(self.render(node.value, node.lineno), "exception", f"raise {self.exc_class}", self.exc_class,
                     node.lineno)
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        if self.exc_class and self.method in ("__str__", "__repr__", "message") and node.value is not None:
            self.add(self.render(node.value, node.lineno), "exception", f"raise {self.exc_class}", self.exc_class,
                     node.lineno)
        self.generic_visit(node)

    # ---- scopes
    def visit_Module(self, node: ast.Module) -> None:
        self.scopes.append(_assignments(node.body))
        self.generic_visit(node)
        self.scopes.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scopes.append(_assignments(node.body))
        outer, self.method = self.method, node.name
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()
        self.method = outer
        self.scopes.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    # ---- rendering an expression to message texts (with MARKs), or None: no literal text
    def render(self, node: ast.expr | None, line: int) -> list[str] | None:
        self.depth += 1
        try:
            if self.depth > 12 or node is None:
                return None
            return self._render(node, line)
        finally:
            self.depth -= 1

    def _or_mark(self, node: ast.expr, line: int) -> list[str]:
        return self.render(node, line) or [MARK]

    def _render(self, node: ast.expr, line: int) -> list[str] | None:
        if isinstance(node, ast.Constant):
            return [node.value] if isinstance(node.value, str) else None
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    parts.append(v.value)
                else:
                    if isinstance(v, ast.FormattedValue) and _is_caught(v.value, self.caught):
                        self.wraps = True
                    parts.append(MARK)
            return ["".join(parts)]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.render(node.left, line), self.render(node.right, line)
            if left is None and right is None:
                return None
            return _product(left or [MARK], right or [MARK])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            left = self.render(node.left, line)
            return [percent(t) for t in left] if left is not None else None
        if isinstance(node, ast.IfExp):
            body, orelse = self.render(node.body, line), self.render(node.orelse, line)
            if body is None and orelse is None:
                return None
            return _unique((body or [MARK]) + (orelse or [MARK]))
        if isinstance(node, ast.Call):
            return self._render_call(node, line)
        if isinstance(node, ast.Name):
            return self._resolve(node.id, line)
        return None

    def _render_call(self, node: ast.Call, line: int) -> list[str] | None:
        func, name = node.func, _callee(node.func)
        if isinstance(func, ast.Attribute) and name == "format":
            base = self.render(func.value, line)
            return [braces(t) for t in base] if base is not None else None
        if isinstance(func, ast.Attribute) and name in ("strip", "rstrip", "lstrip", "capitalize"):
            return self.render(func.value, line)
        if name in ("_", "gettext", "dedent", "N_") and node.args:
            return self.render(node.args[0], line)
        if isinstance(func, ast.Attribute) and name == "join" and node.args \
                and isinstance(func.value, ast.Constant) and isinstance(func.value.value, str) \
                and isinstance(node.args[0], (ast.List, ast.Tuple)):
            pieces = [self.render(e, line) for e in node.args[0].elts]
            if all(p is None for p in pieces):
                return None
            out = [""]
            for i, p in enumerate(pieces):
                out = _product(out, [func.value.value] if i else [""])
                out = _product(out, p or [MARK])
            return out
        return None

    def _resolve(self, name: str, line: int) -> list[str] | None:
        """A name bound to a string: in this function before ``line``, else in an enclosing scope."""
        for depth, scope in enumerate(reversed(self.scopes)):
            bound = scope.get(name)
            if not bound:
                continue
            before = [b for b in bound if b[0] < line] if depth == 0 else bound
            if not before:
                continue
            plain = [b for b in before if not b[2]]
            if not plain:
                return None
            out: list[str] = []
            for lineno, value, _aug in plain[-MAX_ALTERNATIVES:]:
                got = self.render(value, lineno)
                if got is None:
                    continue
                # a short start built up with +=: the pieces that follow, in order
                if all(cat.literal_chars(percent(t)) < cat.MIN_LITERAL_CHARS for t in got):
                    for lineno2, value2, aug2 in before:
                        if aug2 and lineno2 > lineno:
                            got = _product(got, self.render(value2, lineno2) or [MARK])
                out.extend(got)
            return _unique(out) or None
        return None

    # ---- the places a message is printed
    def add(self, texts: list[str] | None, level: str, kind: str, exc: str, line: int) -> None:
        for text in texts or ():
            entry = {"level": level, "text": text, "kind": kind, "exc": exc, "line": line}
            if self.functions:
                entry["func"] = self.functions[-1]  # the code that prints it: start-up or serving
            if self.wraps:
                entry["wraps"] = True  # it formats the exception it caught: a wrapper of whatever that was
            self.entries.append(entry)
        self.wraps = False

    def first_message(self, node: ast.Call, line: int) -> list[str] | None:
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                continue
            got = self.render(arg, line)
            if got is not None:
                return got
        for kw in node.keywords:
            if kw.arg in ("msg", "message", "detail", "reason", "error"):
                return self.render(kw.value, line)
        return None

    def visit_Raise(self, node: ast.Raise) -> None:
        exc = node.exc
        if isinstance(exc, ast.Call):
            name = _callee(exc.func)
            if name and not EXC_NAME.match(name) and not name.endswith("Warning"):
                self.add(self.first_message(exc, node.lineno), "exception", f"raise {name}", name, node.lineno)
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        if node.msg is not None:
            self.add(self.render(node.msg, node.lineno), "error", "assert", "AssertionError", node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name, func, line = _callee(node.func), node.func, node.lineno
        receiver = _receiver(func).lower()
        if EXC_NAME.match(name):
            self.add(self.first_message(node, line), "exception", f"raise {name}", name, line)
        elif name == "__init__" and self.exc_class and isinstance(func, ast.Attribute) \
                and isinstance(func.value, ast.Call) and _callee(func.value.func) == "super":
            self.add(self.first_message(node, line), "exception", f"raise {self.exc_class}", self.exc_class, line)
        elif isinstance(func, ast.Attribute) and name.removesuffix("_once") in LEVELS and (
                receiver.endswith(("logger", "log")) or receiver == "logging"):
            level = LEVELS[name.removesuffix("_once")]
            if node.args:
                texts = self.render(node.args[0], line)
                if texts is not None and len(node.args) > 1:
                    texts = [percent(t) for t in texts]
                self.add(texts, level, f"{_dotted(func.value).rsplit('.', 1)[-1]}.{name}", "", line)
        elif name == "warn" and (_receiver(func) == "warnings" or isinstance(func, ast.Name)) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Call) and _callee(first.func).endswith("Warning"):
                texts = self.first_message(first, line)
            else:
                texts = self.render(first, line)
            self.add(texts, "warning", "warnings.warn", "", line)
        elif name == "print" and isinstance(func, ast.Name) and any(
                kw.arg == "file" and _dotted(kw.value) == "sys.stderr" for kw in node.keywords):
            pieces = [self.render(a, line) for a in node.args if not isinstance(a, ast.Starred)]
            if any(p is not None for p in pieces):
                texts = [""]
                for i, p in enumerate(pieces):
                    texts = _product(texts, [" "] if i else [""])
                    texts = _product(texts, p or [MARK])
                self.add(texts, "error", "print stderr", "", line)
        elif name == "exit" and _dotted(func) == "sys.exit" and node.args:
            self.add(self.render(node.args[0], line), "error", "sys.exit", "SystemExit", line)
        elif name == "error" and receiver in ("parser", "self") and self.module.endswith("argparse.py") and node.args:
            self.add(self.render(node.args[0], line), "error", "parser.error", "", line)
        self.generic_visit(node)


def _is_caught(node: ast.expr, caught: list[str]) -> bool:
    """``e``, ``str(e)``, ``repr(e)``, ``e.args``... of a name an enclosing ``except`` bound."""
    names = {c for c in caught if c}
    if not names:
        return False
    if isinstance(node, ast.Call) and _callee(node.func) in ("str", "repr") and node.args:
        node = node.args[0]
    if isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in names


def _product(a: list[str], b: list[str]) -> list[str]:
    return _unique([x + y for x in a for y in b])[:MAX_ALTERNATIVES]


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))[:MAX_ALTERNATIVES]


def harvest_python(source: bytes, module: str, drop_levels: Iterable[str] = ()) -> list[dict[str, Any]]:
    try:
        tree = ast.parse(source, module)
    except (SyntaxError, ValueError):
        log(f"{module}: not parseable, skipped")
        return []
    h = PyHarvester(module)
    h.visit(tree)
    out = []
    for e in h.entries:
        if e["level"] in drop_levels:
            continue
        text = e.pop("text")
        for piece in lines_of(text):
            pattern = to_pattern(piece)
            if keepable(pattern, e["level"]):
                entry = {**e, "pattern": pattern, "module": module}
                if piece != text:  # one line of a longer message: its family is the message's
                    entry["whole"] = to_pattern(text)
                out.append(entry)
    return out


def lines_of(text: str) -> list[str]:
    """A message as the lines it prints: a log is read line by line, so a pattern that spans a
    newline could never match; each line of a multi-line message is a pattern of its own."""
    return [piece for piece in text.split("\n") if piece.strip()]


# =========================================================================== libraries

_PRINTF = re.compile(r"%%|%[-#0 +']*(?:\*|\d+)?(?:\.(?:\*|\d+))?(?:hh|h|ll|l|L|q|j|z|Z|t)?[diouxXeEfFgGaAcspn]"
                     r"|%(?:PRI|SC)[diouxX](?:8|16|32|64|PTR|MAX)|\{(?:\d+|[a-z_]+)?(?::[^{}]{0,12})?\}")
_RUN = re.compile(rb"[\x09\x0a\x20-\x7e]{12,}")
MAX_LIB_STRING = 1000  # a longer printable run is a table or a blob, not a message
_WORDS = re.compile(r"\b[A-Za-z][a-z]+\b")  # words, not ALLCAPS names
_NOT_A_MESSAGE = re.compile(r"->|=>|\(Tensor|Tensor\(|\b_Z|GLIBC|\$|\\|@@|\.(?:cpp|cu|cuh|hpp|h|cc|rs|py|so)\b|"
                            r"\bstd::|<[A-Za-z_:]{1,80}>|\b\w{1,80}\(\)\s*const|^\s*[-=*#]{3}")
_FAILURE = re.compile(r"(?i)fail|error|invalid|unable|cannot|can't|could not|couldn't|not supported|unsupported|"
                      r"mismatch|timeout|timed out|abort|unexpected|exceed|refused|closed|reset|unknown|wrong|"
                      r"unhandled|crash|not found|no such|denied|out of|insufficient|exhaust|corrupt|illegal|"
                      r"overflow|too (?:many|large|small|long)|must|expected|not enough|lost|dead|died|broken")
_PUNCT_OK = set(" .,:;'\"()[]!?-_/=%<>*+#|`~&^")


def printf_marks(text: str) -> str:
    return _PRINTF.sub(lambda m: "%" if m.group() == "%%" else MARK, text)


def human(text: str) -> bool:
    """A library string that reads like a message: mostly letters, spaces and plain punctuation,
    three words at least (two with a placeholder), one of them lower-case, no code or mangled
    names."""
    if _NOT_A_MESSAGE.search(text):
        return False
    body = text.replace(MARK, " ").strip()
    if not body or not body[0].isalpha() and body[0] not in "[('\"":
        return False
    letters = sum(c.isalpha() or c.isspace() for c in body)
    if letters < 0.8 * len(body) or any(not (c.isalnum() or c in _PUNCT_OK) for c in body):
        return False
    if any(len(tok) > 40 for tok in body.split()):
        return False
    words = _WORDS.findall(body)
    return len(words) >= (2 if MARK in text else 3) and " " in body and any(w.islower() for w in words)


def lib_strings(data: bytes) -> Iterator[str]:
    for m in _RUN.finditer(data):
        if m.end() - m.start() <= MAX_LIB_STRING:
            yield m.group().decode("ascii")


def table_strings(data: bytes, first: str, last: str) -> list[str]:
    """The NUL-separated strings from ``first`` to ``last`` (an error-string table)."""
    start = data.find(b"\x00" + first.encode() + b"\x00")
    if start < 0:
        raise SystemExit(f"harvest: table start {first!r} not found")
    out: list[str] = []
    pos = start + 1
    while len(out) < 4000:
        end = data.find(b"\x00", pos)
        if end < 0:
            break
        raw = data[pos:end]
        pos = end + 1
        if not raw:
            continue
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            continue
        if text.isprintable():
            out.append(text)
        if text == last:
            return out
    raise SystemExit(f"harvest: table end {last!r} not found after {first!r}")


_ENUM = re.compile(r"^(?:cuda|nccl|cu|CU)[A-Za-z]*(?:Error|Success)\w*$|^cudaSuccess$")
_SUCCESS = {"no error", "cudaSuccess", "success", "ncclSuccess"}


def harvest_lib(data: bytes, spec: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    module = spec["path"]
    seen: set[str] = set()
    if "table" in spec:
        items = table_strings(data, *spec["table"])
        for i, text in enumerate(items):
            if text in _SUCCESS:
                continue
            pattern = to_pattern(text)
            if pattern in seen or not keepable(pattern, "table"):
                continue
            seen.add(pattern)
            entry = {"level": "table", "pattern": pattern, "kind": "table", "exc": "", "module": module, "line": 0}
            if _ENUM.match(text):  # an enum's name: its description follows it in the table
                nxt = items[i + 1] if i + 1 < len(items) else ""
                if nxt and not _ENUM.match(nxt):
                    entry["pair"] = to_pattern(nxt)
            out.append(entry)
    level = spec.get("strings", "lib")
    if level == "none":
        return out
    keep = re.compile(spec["keep"]) if spec.get("keep") else None
    # another library's table linked in statically (NCCL carries cudart's): that library's own source says it
    skip = set(table_strings(data, *spec["skip_table"])) if "skip_table" in spec else set()
    for raw in lib_strings(data):
        if raw in skip:
            continue
        pieces = [p for line in lines_of(raw) for p in (_split_rust(line) if module.endswith(".abi3.so") else [line])]
        for text in pieces:
            marked = printf_marks(text)
            if marked.rstrip().endswith(":"):  # "NCCL error in: " + a value: the value is a placeholder
                marked = marked.rstrip() + " " + MARK
            if keep is not None and not keep.search(text):
                continue
            if not (human(marked) or wrapper(marked) or (spec.get("force") and keep is not None)):
                continue  # ("force": what `keep` finds is a message, however it looks: "*** %s received at ...")
            if level == "warn" and not _FAILURE.search(text):
                continue
            pattern = to_pattern(marked)
            if pattern in seen or not keepable(pattern, level):
                continue
            seen.add(pattern)
            out.append({"level": level, "pattern": pattern, "kind": "string", "exc": "", "module": module, "line": 0})
    return out


def _split_rust(run: str) -> list[str]:
    """A Rust binary's strings run together: cut where a lower-case letter meets an upper-case one,
    and drop a leading length byte that happens to be printable."""
    pieces = re.split(r"(?<=[a-z.])(?=[A-Z][a-z])", run)
    return [p[1:] if len(p) > 1 and not p[0].isalnum() and p[1].isupper() else p for p in pieces]


_C_STRING = re.compile(r'"((?:[^"\\\n]|\\.)*)"((?:\s|\\\n)*"(?:[^"\\\n]|\\.)*")*')
_C_PIECE = re.compile(r'"((?:[^"\\\n]|\\.)*)"')


def harvest_c(source: str, module: str) -> list[dict[str, Any]]:
    out = []
    for m in _C_STRING.finditer(source):
        text = "".join(p.group(1) for p in _C_PIECE.finditer(m.group()))
        text = text.replace('\\"', '"').replace("\\n", "\n").replace("\\t", " ").replace("\\\\", "\\")
        for piece in lines_of(text):
            marked = printf_marks(piece)
            if marked.rstrip().endswith(":"):  # const char *prefix = "Triton Error [CUDA]: "; a value follows
                marked = marked.rstrip() + " " + MARK
            if not (human(marked.strip()) or wrapper(marked)) or not _FAILURE.search(piece):
                continue  # C strings: only what reports a failure
            pattern = to_pattern(marked)
            if keepable(pattern, "lib"):
                line = source.count("\n", 0, m.start()) + 1
                out.append({"level": "lib", "pattern": pattern, "kind": "C string", "exc": "", "module": module,
                            "line": line})
    return out



# =========================================================================== a source


def wanted(member: str, src: dict[str, Any]) -> bool:
    return member.endswith(".py") and any(member.startswith(p) for p in src.get("python", ())) \
        and not any(x in member for x in src.get("exclude", ()))



def harvest_wheel(src: dict[str, Any], wheel: Path) -> dict[str, Any]:
    entries: list[dict[str, Any]] = []
    modules: list[str] = []
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if ".dist-info/" not in n and ".data/" not in n)
        modules = [n for n in names if n.endswith(".py")]
        for n in modules:
            if wanted(n, src):
                entries.extend(harvest_python(z.read(n), n, src.get("drop_levels", ())))
        for c in src.get("c_sources", ()):
            entries.extend(harvest_c(z.read(c).decode("utf-8", "replace"), c))
        for spec in src.get("libs", ()):
            t0 = time.monotonic()
            data = z.read(spec["path"])
            got = harvest_lib(data, spec)
            del data
            kinds = Counter(e["level"] for e in got)
            log(f"  {spec['path']}: kept {len(got)} strings ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}) "
                f"in {time.monotonic() - t0:.0f} s")
            entries.extend(got)
    return {"entries": entries, "modules": modules}


def harvest_stdlib(src: dict[str, Any]) -> dict[str, Any]:
    root = Path(sysconfig.get_paths()["stdlib"])
    entries: list[dict[str, Any]] = []
    for rel in src.get("stdlib", ()):
        entries.extend(harvest_python((root / rel).read_bytes(), rel, src.get("drop_levels", ())))
    if src.get("strerror"):
        for code in sorted(errno.errorcode):
            text = os.strerror(code)
            if text.startswith("Unknown error"):
                continue
            pattern = to_pattern(text)
            if keepable(pattern, "lib"):  # a string of the C library, printed inside other messages
                entries.append({"level": "lib", "pattern": pattern, "kind": f"strerror({errno.errorcode[code]})",
                                "exc": "OSError", "module": "strerror", "line": 0})
    if src.get("signals"):
        # the kernel's signal names, as a signal handler prints them ("*** SIGBUS received at ...")
        for sig in sorted(signal.Signals, key=lambda s: s.value):
            entries.append({"level": "table", "pattern": sig.name, "kind": "signal", "exc": "",
                            "module": "signal", "line": 0})
    modules: list[str] = []
    for rel in src.get("modules", ()):
        p = root / rel
        if p.is_dir():
            modules.extend(str(f.relative_to(root)) for f in sorted(p.rglob("*.py")) if "test" not in f.parts)
        elif p.exists():
            modules.append(rel)
    return {"entries": entries, "modules": sorted(modules)}
