"""A section's TOML table validated into its dataclass: unknown keys refused (with the closest
known one), each value converted to the field's type with no silent casts, then checked
against its rule; ``[[diagnosis.rule]]`` tables into ``SiteRule``s."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from supervisor.core.config.rules import ConfigError, _did_you_mean, _show
from supervisor.core.config.sections import DiagnosisConfig
from supervisor.core.config.units import Config
from supervisor.core.diagnosis.site_rules import SITE_CAUSES, pattern_problem
from supervisor.core.model import Cause, Phase, SiteRule

_SECTIONS: dict[str, type] = {
    name: hint for name, hint in typing.get_type_hints(Config).items() if name not in ("name", "units")
}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}s"
    if origin is dict:
        return "a table of strings"
    return {bool: "true/false", int: "integer", float: "number", str: "string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` converted to ``tp``, or raise TypeError. No silent string->number casts."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except TypeError:
                continue
        raise TypeError
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise TypeError
        (item_type, _ellipsis) = typing.get_args(tp)
        return tuple(_coerce(v, item_type) for v in value)
    if origin is dict:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise TypeError
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise TypeError
            return float(value)
        raise TypeError
    if tp is str:
        if isinstance(value, str) and "\x00" not in value:
            return value
        raise TypeError
    raise TypeError


def _build_section(where: str, section: str, cls: type, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: [{section}] must be a table, not {_show(raw)}")
    if cls is DiagnosisConfig:
        return _build_diagnosis(where, raw)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            hint = _did_you_mean(key, fields, "'{}'")
            raise ConfigError(f"{where}: [{section}] {key}: unknown key{hint} (known: {known})")
        meta = fields[key].metadata
        rule = meta.get("rule") or _type_name(hints[key])
        try:
            converted = _coerce(value, hints[key])
        except TypeError:
            raise ConfigError(
                f"{where}: [{section}] {key} = {_show(value)}: must be {rule}"
            ) from None
        check = meta.get("check")
        if check is not None and converted is not None and not check(converted):
            raise ConfigError(f"{where}: [{section}] {key} = {_show(value)}: must be {rule}")
        kwargs[key] = converted
    return cls(**kwargs)


_RULE_KEYS = ("match", "cause", "phase", "certain")
_RULE_EXAMPLE = "e.g. match = 'MyKernelError: .{0,80} failed'"


def _build_diagnosis(where: str, raw: dict[str, Any]) -> DiagnosisConfig:
    """``[diagnosis]``: its one key ``rule``, an array of tables (``[[diagnosis.rule]]``)."""
    for key in raw:
        if key != "rule":
            hint = _did_you_mean(key, ("rule",), "'{}'")
            raise ConfigError(f"{where}: [diagnosis] {key}: unknown key{hint} (known: rule, as [[diagnosis.rule]] tables)")
    entries = raw.get("rule", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{where}: [diagnosis] rule = {_show(entries)}: must be an array of tables, "
                          "each written [[diagnosis.rule]] with match and cause")
    return DiagnosisConfig(rules=tuple(_site_rule(f"{where}: [[diagnosis.rule]] #{i}", entry)
                                       for i, entry in enumerate(entries, 1)))


def _site_rule(label: str, entry: dict[str, Any]) -> SiteRule:
    """One ``[[diagnosis.rule]]`` table; ``label`` names it ("kimi.toml: [[diagnosis.rule]] #2")."""
    for key in entry:
        if key not in _RULE_KEYS:
            hint = _did_you_mean(key, _RULE_KEYS, "'{}'")
            raise ConfigError(f"{label} {key}: unknown key{hint} (known: {', '.join(sorted(_RULE_KEYS))})")
    causes = ", ".join(str(c) for c in SITE_CAUSES)
    if "match" not in entry:
        raise ConfigError(f"{label} match: missing: a regex searched in each line of a crash ({_RULE_EXAMPLE})")
    match = entry["match"]
    if not isinstance(match, str):
        raise ConfigError(f"{label} match = {_show(match)}: must be a string, a regex ({_RULE_EXAMPLE})")
    if (problem := pattern_problem(match)) is not None:
        raise ConfigError(f"{label} match = {_show(match)}: {problem}")
    if "cause" not in entry:
        raise ConfigError(f"{label} cause: missing: the cause the line names, one of {causes}")
    value = entry["cause"]
    cause = next((c for c in SITE_CAUSES if isinstance(value, str) and value == str(c)), None)
    if cause is None:
        if isinstance(value, str) and value in {str(c) for c in Cause}:
            raise ConfigError(f"{label} cause = {_show(value)}: the daemon's own cause, never read from a log "
                              f"(one of {causes})")
        hint = _did_you_mean(value, [str(c) for c in SITE_CAUSES], "'{}'") if isinstance(value, str) else ""
        raise ConfigError(f"{label} cause = {_show(value)}: unknown cause{hint} (one of {causes})")
    phase: Phase | None = None
    if "phase" in entry:
        value = entry["phase"]
        phase = next((p for p in Phase if isinstance(value, str) and value == str(p)), None)
        if phase is None:
            hint = _did_you_mean(value, [str(p) for p in Phase], "'{}'") if isinstance(value, str) else ""
            raise ConfigError(f'{label} phase = {_show(value)}: must be "starting" or "serving"{hint}')
    certain = entry.get("certain", False)
    if not isinstance(certain, bool):
        raise ConfigError(f"{label} certain = {_show(certain)}: must be true or false")
    return SiteRule(match=match, cause=cause, phase=phase, certain=certain)
