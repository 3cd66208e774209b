"""Startup facts: the memory numbers SGLang prints per rank while it starts.

Pure: no I/O, no clock. The daemon feeds every line the server prints to a
``StartupFactsParser``; ``feed`` is built to be cheap for the common line that carries no
fact (a handful of substring tests before any regular expression).

Formats handled (see ``sglang-facts.md``), 0.5.6 and 0.5.23:

- ``Load weight end. [elapsed=T s, ]type=X, ..., avail mem=A GB, mem usage=U GB.``
- ``KV Cache is allocated. [dtype: D, ]#tokens: N, K size: K GB, V size: V GB`` (MLA models:
  ``#tokens: N, KV size: S GB``)
- ``Memory pool end. avail mem=A GB``
- ``Capture cuda graph end. Time elapsed: T s. mem usage=U GB. avail mem=A GB.`` and the
  0.5.23 variants ``Capture target decode CUDA graph end. bs=[...], ..., avail mem=A GB.``;
  old versions print no ``avail mem`` there, and then there is no such fact.
- ``max_total_num_tokens=N, chunked_prefill_size=..., available_gpu_mem=A GB``
- ``Allocating X GB host memory for hierarchical KV cache.`` and
  ``Allocating <name> hierarchical KV host pool: N tokens, X GB host memory.``
- progress: weights loading, KV pool, CUDA-graph capture (tqdm bars included), warmup, and
  ``The server is fired up and ready to roll!``.

- speculative decoding: a rank's second ``Load weight end`` (after its KV pool), and the
  ``KV Cache is allocated`` / ``Memory pool end`` after it, are the draft model's
  (``draft_*`` fields); the target's stay as they were.
- ``server_args=ServerArgs(... mem_fraction_static=X ...)`` (0.5.6) or ``server_args={...
  'mem_fraction_static': X ...}`` (0.5.23): the fraction SGLang chose.

Values are taken only from the line that states them; nothing is guessed. A rank is the
``DPn PPn ATTN_CPn MOE_DPn TPn EPn`` part (any of them) of the line's
``[YYYY-mm-dd HH:MM:SS ...]`` prefix; lines without one go under ``"main"``.
``SOURCE_PATTERNS`` says where each line's text comes from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from supervisor.core.model import RankFacts, StartupFacts

MAIN_RANK = "main"

# Progress, in the order a healthy start goes through it. Progress never moves backwards:
# with several ranks it is how far the furthest rank got.
PROGRESS_ORDER: tuple[str, ...] = (
    "unknown",
    "launching",
    "loading_weights",
    "kv_pool",
    "capture",
    "warmup",
    "ready",
)
_PROGRESS_RANK = {name: i for i, name in enumerate(PROGRESS_ORDER)}

_NUM = r"([0-9]{1,12}(?:\.[0-9]{1,12})?)"
_GB = r"\s?(GB|GiB|MB|MiB)\b"

# Rank prefixes. SGLang: "[2025-08-02 19:24:30 TP3] " or "[... DP1 TP3 EP3] " (ms optional).
_SGLANG_PREFIX = re.compile(
    r"\[\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d{1,6})?((?: [A-Z]{2,4}(?:_[A-Z]{2,4})?\d{1,5}){1,8})\]"
)
# vLLM worker names: "(Worker_TP7_DCP1_EP7 pid=641)".
_VLLM_WORKER = re.compile(r"\(Worker((?:_[A-Za-z]{1,8}\d{1,5}){1,6}) pid=\d{1,10}\)")
_VLLM_RANK_TOKEN = re.compile(r"^(?:DP|TP|PP|EP)\d{1,5}$")
# torch.distributed: "[rank6]:".
_TORCH_RANK = re.compile(r"\[rank(\d{1,5})\]:")
# SGLang's process names in its own messages: "Subprocess scheduler_DP1_TP3 (pid=1) crashed".
_PROCESS_NAME = re.compile(r"\bscheduler_((?:(?:DP|TP|PP|EP|ATTN_CP|MOE_DP)\d{1,5}_?){1,6})")
_RANK_TOKEN = re.compile(r"(?:ATTN_CP|MOE_DP|DP|TP|PP|EP)\d{1,5}")


def line_rank(line: str, end: int | None = None) -> str | None:
    """The rank a log line carries ("TP3", "DP1 TP3", "rank6"), or None.

    From SGLang's ``[date time TPn]`` prefix, vLLM's ``(Worker_TPn pid=N)``, torch's
    ``[rankN]:``, or SGLang naming a scheduler process (``scheduler_DP1_TP3``).

    With ``end``, only prefixes that start before that index count (the last one wins), so
    a fact glued after another rank's progress bar is credited to its own rank.
    """
    text = line if end is None else line[:end]
    last = None
    for prefix in _SGLANG_PREFIX.finditer(text):
        last = prefix
    if last is not None:
        return last.group(1).strip()
    m = _VLLM_WORKER.search(text)
    if m:
        tokens = [t for t in m.group(1).split("_") if _VLLM_RANK_TOKEN.match(t)]
        if tokens:
            return " ".join(tokens)
    m = _TORCH_RANK.search(text)
    if m:
        return f"rank{m.group(1)}"
    m = _PROCESS_NAME.search(text)
    if m:
        return " ".join(_RANK_TOKEN.findall(m.group(1)))
    return None


def _gb(value: str, unit: str) -> float:
    number = float(value)
    return number / 1024.0 if unit.upper().startswith("M") else number


_AVAIL_MEM = re.compile(r"avail mem=\s?" + _NUM + _GB)
_MEM_USAGE = re.compile(r"mem usage=\s?" + _NUM + _GB)
_KV_TOKENS = re.compile(r"#tokens: ?([0-9]{1,15})")
_K_SIZE = re.compile(r"\bK size: ?" + _NUM + _GB)
_V_SIZE = re.compile(r"\bV size: ?" + _NUM + _GB)
_KV_SIZE = re.compile(r"\bKV size: ?" + _NUM + _GB)
_MAX_TOTAL = re.compile(r"\bmax_total_num_tokens=([0-9]{1,15})")
# "server_args=ServerArgs(... mem_fraction_static=0.82, ...)" (<= 0.5.6) or, in 0.5.23,
# "server_args={... 'mem_fraction_static': 0.719, ...}"
_MEM_FRACTION = re.compile(r"\bmem_fraction_static(?:=|': ?)([0-9]{1,3}(?:\.[0-9]{1,12})?)\b")
_CAPTURE_END = re.compile(r"Capture [A-Za-z ]{0,60}?graph end", re.IGNORECASE)
# "Allocating 40.00 GB host memory for hierarchical KV cache."
_HOST_POOL_OLD = re.compile(r"Allocating " + _NUM + _GB + r" host memory for hierarchical")
# "Allocating MHA hierarchical KV host pool: 1000 tokens, 40.00 GB host memory."
_HOST_POOL_NEW = re.compile(
    r"Allocating ([\w.-]{0,40}) ?hierarchical KV host pool:[^\n]{0,80}?" + _NUM + _GB + r" host memory"
)

# Where the text each fact or progress line is read from comes from: (what the parser looks
# for, its origin, literal pieces of it that occur in that origin's source). The source
# contract test checks every "sglang" one against the installed SGLang.
SOURCE_PATTERNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Load weight begin", "sglang", ("Load weight begin. avail mem=",)),
    ("Load weight end ... avail mem= ... mem usage=", "sglang", ('f"Load weight end. "', "avail mem=", "mem usage=")),
    ("KV Cache is allocated ... #tokens: N, K size / V size / KV size", "sglang",
     ('"KV Cache"', "'is allocated'", "#tokens: {num_tokens}, K size: ", "V size: ", "KV size: ")),
    ("Memory pool end. avail mem=", "sglang", ("Memory pool end. ",)),
    ("Capture ... graph end ... avail mem=", "sglang", ("CUDA graph end. ", "avail mem={after_mem")),
    ("Capturing batches", "sglang", ("Capturing batches",)),
    ("max_total_num_tokens=", "sglang", ('f"max_total_num_tokens={self.max_total_num_tokens}, "',)),
    ("Allocating <name> hierarchical KV host pool: N tokens, X GB host memory", "sglang",
     ("hierarchical KV host pool: ",)),
    ("Allocating X GB host memory for hierarchical KV cache", "sglang-legacy", ()),
    ("The server is fired up and ready to roll!", "sglang", ("The server is fired up and ready to roll!",)),
    ("server_args={... 'mem_fraction_static': X ...}", "sglang",
     ('f"server_args={_server_args_for_logging(server_args)}"', "mem_fraction_static: Optional[float]")),
    ("rank prefix [date time DPn PPn ATTN_CPn MOE_DPn TPn EPn]", "sglang",
     ('f" DP{', 'f" PP{', 'f" ATTN_CP{', 'f" MOE_DP{', 'f" TP{', 'f" EP{')),
    ("Subprocess scheduler_N (pid=P) crashed", "sglang", ('f"Subprocess {name} (pid={proc.pid}) crashed "',)),
    ("Uvicorn running", "uvicorn", ()),
    ("Loading safetensors checkpoint shards", "sglang", ("Loading safetensors checkpoint shards",)),
)

# Lines that move the progress (a line may hold several: the furthest wins).
_PROGRESS_MARKERS: tuple[tuple[str, str], ...] = (
    ("Load weight begin", "loading_weights"),
    ("shards", "loading_weights"),  # "Loading safetensors checkpoint shards: 40% ..."
    ("Load weight end", "kv_pool"),
    ("KV Cache is allocated", "kv_pool"),
    ("Memory pool end", "kv_pool"),
    ("apture", "capture"),  # "Capture cuda graph begin/end", "Capture target decode CUDA graph end"
    ("Capturing", "capture"),  # the capture progress bar
    ("armup", "warmup"),
    ("Uvicorn running", "warmup"),  # HTTP is up; the warmup request comes next
    ("ready to roll", "ready"),
)

# Cheap pre-check: every fact or progress line contains one of these.
_PRECHECK = (
    "GB", "MB", "apture", "Capturing", "ready to roll", "shards", "armup", "Load weight", "Uvicorn running",
    "max_total_num_tokens", "mem_fraction_static",
)


def _could_matter(line: str) -> bool:
    return any(key in line for key in _PRECHECK)


@dataclass(slots=True)
class _RankState:
    facts: RankFacts
    host_pools: dict[str, float] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)  # stage line -> times this rank printed it


# Stage lines a speculative-decoding server prints twice per rank ("Load weight end", "KV
# Cache is allocated", "Memory pool end"): the target model's first, then the draft
# model's. The second one's facts go to the ``draft_*`` fields (see ``_second``).


class StartupFactsParser:
    """Incremental parser of SGLang's startup lines; feed it every line the server prints."""

    def __init__(self) -> None:
        self._ranks: dict[str, _RankState] = {}
        self._progress = "unknown"
        self._ready = False
        self._mem_fraction: float | None = None
        self._cached: StartupFacts | None = StartupFacts()

    @property
    def facts(self) -> StartupFacts:
        """The facts seen so far (an immutable snapshot)."""
        if self._cached is None:
            self._cached = StartupFacts(
                ranks={key: state.facts for key, state in self._ranks.items()},
                progress=self._progress,
                ready=self._ready,
                mem_fraction_static=self._mem_fraction,
            )
        return self._cached

    def feed(self, line: str) -> bool:
        """Read one line; True when it changed a fact or the progress."""
        changed = self._advance("launching")
        if not _could_matter(line):
            return changed
        # tqdm bars rewrite themselves with "\r"; log lines of other ranks can land inside.
        for segment in line.split("\r") if "\r" in line else (line,):
            changed = self._feed_segment(segment) or changed
        return changed

    def _feed_segment(self, line: str) -> bool:
        changed = False
        for marker, progress in _PROGRESS_MARKERS:
            if marker in line:
                changed = self._advance(progress) or changed
        if "ready to roll" in line and not self._ready:
            self._ready = True
            self._cached = None
            changed = True
        if (pos := line.find("Load weight end")) >= 0:
            avail, usage = _search_gb(_AVAIL_MEM, line, pos), _search_gb(_MEM_USAGE, line, pos)
            draft = self._second(line, pos, "Load weight end")
            changed = self._set(line, pos, draft + "avail_mem_after_weights_gb", avail) or changed
            changed = self._set(line, pos, draft + "weights_gb", usage) or changed
        if (pos := line.find("KV Cache is allocated")) >= 0:
            m = _KV_TOKENS.search(line, pos)
            draft = self._second(line, pos, "KV Cache is allocated")
            changed = self._set(line, pos, draft + "kv_cache_tokens", int(m.group(1)) if m else None) or changed
            changed = self._set(line, pos, draft + "kv_cache_gb", _kv_size(line, pos)) or changed
        if (pos := line.find("Memory pool end")) >= 0:
            draft = self._second(line, pos, "Memory pool end")
            value = _search_gb(_AVAIL_MEM, line, pos)
            changed = self._set(line, pos, draft + "avail_mem_after_pool_gb", value) or changed
        if "server_args=" in line and "mem_fraction_static" in line and (m := _MEM_FRACTION.search(line)):
            value = float(m.group(1))
            if value != self._mem_fraction:
                self._mem_fraction = value
                self._cached = None
                changed = True
        if "apture" in line and (end := _CAPTURE_END.search(line)):
            value = _search_gb(_AVAIL_MEM, line, end.start())
            changed = self._set(line, end.start(), "avail_mem_after_capture_gb", value) or changed
        if "max_total_num_tokens=" in line and (m := _MAX_TOTAL.search(line)):
            changed = self._set(line, m.start(), "max_total_num_tokens", int(m.group(1))) or changed
        if "hierarchical" in line:
            changed = self._host_pool(line) or changed
        return changed

    def _host_pool(self, line: str) -> bool:
        m = _HOST_POOL_NEW.search(line)
        name = ""
        if m:
            name, value = m.group(1), _gb(m.group(2), m.group(3))
        else:
            m = _HOST_POOL_OLD.search(line)
            if not m:
                return False
            value = _gb(m.group(1), m.group(2))
        state = self._state(line_rank(line, m.start()) or MAIN_RANK)
        if state.host_pools.get(name) == value:
            return False
        state.host_pools[name] = value
        return self._replace(state, host_kv_pool_gb=round(sum(state.host_pools.values()), 6))

    def _second(self, line: str, pos: int, stage: str) -> str:
        """"draft_" when the line is the draft model's, else "".

        A rank's second ``Load weight end`` after its KV pool was set up starts the draft
        model; its ``KV Cache is allocated`` and ``Memory pool end`` after that are the
        draft's too. A line merely repeated is not a draft's.
        """
        state = self._state(line_rank(line, pos) or MAIN_RANK)
        before = state.seen.get(stage, 0)
        state.seen[stage] = before + 1
        if stage == "Load weight end":
            pool_done = state.seen.get("KV Cache is allocated", 0) + state.seen.get("Memory pool end", 0) > 0
            drafting = before >= 1 and pool_done
            if drafting:
                state.seen["draft"] = 1
            return "draft_" if drafting else ""
        return "draft_" if before >= 1 and state.seen.get("draft") else ""

    def _advance(self, progress: str) -> bool:
        if _PROGRESS_RANK[progress] <= _PROGRESS_RANK[self._progress]:
            return False
        self._progress = progress
        self._cached = None
        return True

    def _state(self, rank: str) -> _RankState:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _RankState(RankFacts(rank=rank))
            self._cached = None
        return state

    def _set(self, line: str, pos: int, name: str, value: float | int | None) -> bool:
        if value is None:
            return False
        state = self._state(line_rank(line, pos) or MAIN_RANK)
        return self._replace(state, **{name: value})

    def _replace(self, state: _RankState, **values: float | int | None) -> bool:
        if all(getattr(state.facts, k) == v for k, v in values.items()):
            return False
        # The field names come from the callers' literals; replace() itself rejects an unknown
        # one, which mypy cannot check through ** of a dict.
        state.facts = replace(state.facts, **values)  # type: ignore[arg-type]
        self._cached = None
        return True


def _search_gb(pattern: re.Pattern[str], line: str, pos: int) -> float | None:
    m = pattern.search(line, pos)
    return _gb(m.group(1), m.group(2)) if m else None


def _kv_size(line: str, pos: int) -> float | None:
    kv = _search_gb(_KV_SIZE, line, pos)
    if kv is not None:
        return kv
    k, v = _search_gb(_K_SIZE, line, pos), _search_gb(_V_SIZE, line, pos)
    if k is None or v is None:
        return None
    return round(k + v, 6)


def parse_startup_facts(text: str) -> StartupFacts:
    """The startup facts of a whole log text."""
    parser = StartupFactsParser()
    for line in text.splitlines():
        parser.feed(line)
    return parser.facts
