"""The server's arguments (argparse, or an exception that names a flag or a constraint)."""

from __future__ import annotations

import re

from supervisor.core.diagnosis.rule import _at_startup, _ci, _raised_by, _raised_or_validation, _Rule
from supervisor.core.model import Cause

RULES: tuple[_Rule, ...] = (
    # -- the server's arguments (argparse, or an exception that names a flag or a constraint)
    _Rule(
        "argparse",
        Cause.CONFIG_ERROR,
        ("error: unrecognized arguments", "error: argument", "error: ambiguous option",
         "error: the following arguments are required", "invalid choice:"),
        origin="python",
        cites=(("error: unrecognized arguments", "cpython 3.11.7 Lib/argparse.py:1871: 'unrecognized arguments: %s'"),
               ("error: argument", "cpython 3.11.7 Lib/argparse.py:776: 'argument %(argument_name)s: %(message)s'"),
               ("error: ambiguous option", "cpython 3.11.7 Lib/argparse.py:2263: 'ambiguous option: %(option)s could match'"),
               ("error: the following arguments are required", "cpython 3.11.7 Lib/argparse.py:2142: "
                "'the following arguments are required: %s'"),
               ("invalid choice:", "cpython 3.11.7 Lib/argparse.py:2552: 'invalid choice: %(value)r (choose from'")),
    ),
    _Rule(
        "constraint",
        Cause.CONFIG_ERROR,
        ("compatible with", "cannot be used", "not supported with", "not supported when", "divisible by",
         "user-specified max_model_len", "trust_remote_code", "no bucket >=", "validation error for"),
        pattern=_ci(
            r"not compatible with|incompatible with|cannot be used (?:together )?with"
            r"|(?:is|are) not supported (?:with|when)|divisible by|user-specified max_model_len"
            r"|trust_remote_code|no bucket >= ?\d|validation error for"
        ),
        context=_raised_or_validation,  # an exception or a validation message, not a warning
        origins=(("user-specified max_model_len", "vllm"), ("no bucket >=", "vllm"), ("validation error for", "pydantic"),
                 ("trust_remote_code", "hf")),
        cites=(("user-specified max_model_len", "vllm/config: 'User-specified max_model_len (%d) is greater than'"),
               ("no bucket >=", "vllm-ascend/hpu bucketing: 'no bucket >= %d'"),
               ("validation error for", "pydantic_core: '%d validation error for %s'"),
               ("trust_remote_code", "transformers dynamic_module_utils: 'set the option `trust_remote_code=True`'"),
               ("divisible by", "sglang/vllm config checks: '... must be divisible by tensor parallel size'"),
               ("compatible with", "sglang server_args.py checks: '... is not compatible with ...'"),
               ("cannot be used", "sglang server_args.py checks: '... cannot be used with ...'"),
               ("not supported with", "sglang server_args.py checks: '... is not supported with ...'"),
               ("not supported when", "sglang server_args.py checks: '... is not supported when ...'")),
    ),
    _Rule(
        "flag_named",
        Cause.CONFIG_ERROR,
        ("valueerror", "assertionerror", "argumenterror", "argumenttypeerror"),
        pattern=re.compile(r"(?<![\w-])--[a-z][a-z0-9-]{1,60}"),
        context=_raised_by(("ValueError", "AssertionError", "ArgumentError", "ArgumentTypeError")),
        origin="python",
        cites=(("valueerror", "CPython builtin ValueError naming a --flag"),
               ("assertionerror", "CPython builtin AssertionError naming a --flag"),
               ("argumenterror", "CPython argparse.ArgumentError"), ("argumenttypeerror", "CPython argparse.ArgumentTypeError")),
    ),
    _Rule(  # a flag or environment value of the wrong type (a string where a number belongs)
        "value_type",
        Cause.CONFIG_ERROR,
        ("typeerror",),
        pattern=re.compile(
            r"TypeError: (?:'str' object cannot be interpreted as an integer"
            r"|[^\n]{0,80}must be (?:an? )?(?:int|integer|float|real number)[^\n]{0,20}, not '?str"
            r"|'[<>]=?' not supported between instances of (?:'str' and '(?:int|float)'|'(?:int|float)' and 'str')"
            r"|unsupported operand type\(s\) for [^\n]{1,6}: (?:'str' and '(?:int|float)'|'(?:int|float)' and 'str'))"
        ),
        context=_at_startup,
        origin="python",
        cites=(("typeerror", "CPython: \"'str' object cannot be interpreted as an integer\", "
                "\"must be real number, not str\", \"'<' not supported between instances of 'str' and 'int'\""),),
    ),
)
