"""``sglang-supervisor fleet list|reset``: the fleet-memory records in etcd (docs/fleet.md).

``list`` prints every record under ``[fleet] prefix``: its key, the lowest fraction the fleet
reached, and the OOMs that led there (when, where). ``reset`` deletes one record (``--key``)
or all of them (``--all``) and says what it deleted. It uses ``[etcd]`` whether or not
``[fleet] enabled`` is on (an operator may clean up after turning it off).

Bad input is one line and exit 2; etcd unreachable is one line and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import IO, Any

from supervisor.cli.common import EXIT_USAGE, fail
from supervisor.core.config import Config
from supervisor.core.fleet import FleetRecord

EXIT_FAILED = 1  # etcd unreachable or refused, or no record at --key


def add_arguments(sub: Any, command: Callable[..., argparse.ArgumentParser], add_config: Callable[..., None],
                  config_example: str) -> None:
    """``fleet list`` and ``fleet reset`` under the ``fleet`` parser's subparsers ``sub``."""
    p = command(
        sub, "list", "every fleet-memory record: key, lowest fraction, OOMs with when and where",
        f"sglang-supervisor fleet list --config {config_example} --json",
    )
    add_config(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = command(
        sub, "reset", "delete a fleet-memory record (--key) or every record under [fleet] prefix (--all)",
        f"sglang-supervisor fleet reset --config {config_example} --key KEY",
        "Delete fleet-memory records: the next launch of that configuration anywhere in the fleet starts "
        "on its own rung again (a daemon keeps the rung it already learned, in its own state).",
    )
    add_config(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--key", metavar="KEY", help="the record's key, as fleet list prints it")
    which.add_argument("--all", action="store_true", help="every record under [fleet] prefix")


def run(args: argparse.Namespace, cfg: Config, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    prefix = cfg.fleet.prefix.rstrip("/") + "/"
    if args.fleet_command == "reset" and not args.all:
        key = args.key or ""
        if not key.startswith(prefix) or key == prefix or any(c.isspace() for c in key):
            shown = key[:200].encode("unicode_escape").decode()
            return fail(f"fleet reset --key {shown!r}: not a fleet record's key (they start with {prefix}; "
                        "fleet list prints them)", EXIT_USAGE)
    from supervisor.adapters.etcd import EtcdError
    from supervisor.cli.run import etcd_client

    client = etcd_client(cfg, f"fleet {args.fleet_command}")  # a ConfigError (exit 2) without [etcd] endpoints

    async def session(work: Callable[[Any], Awaitable[int]]) -> int:
        try:
            return await work(client)
        finally:
            await client.aclose()

    try:
        if args.fleet_command == "list":
            return asyncio.run(session(lambda c: _list(c, prefix, as_json=args.json, out=out)))
        return asyncio.run(session(lambda c: _reset(c, prefix, None if args.all else args.key, out=out)))
    except EtcdError as exc:
        return fail(f"fleet {args.fleet_command}: {exc}", EXIT_FAILED)


async def _list(client: Any, prefix: str, *, as_json: bool, out: IO[str]) -> int:
    entries, _revision = await client.get_prefix(prefix)
    records: list[dict[str, Any]] = []
    for kv in sorted(entries, key=lambda e: e.key):
        try:
            record = FleetRecord.from_json(kv.key, kv.value)
        except ValueError as exc:
            records.append({"key": kv.key, "error": str(exc)})
            continue
        records.append({"key": record.key, "rung": record.rung, "updated": record.updated,
                        "ooms": [o.to_dict() for o in record.ooms], "kept": record.kept,
                        "points": [p.to_dict() for p in sorted(record.points, key=lambda p: p.fraction)]})
    if as_json:
        print(json.dumps({"prefix": prefix, "records": records}, indent=1), file=out)
        return 0
    if not records:
        print(f"no fleet records under {prefix}", file=out)
        return 0
    for i, r in enumerate(records):
        if i:
            print(file=out)
        print(r["key"], file=out)
        if "error" in r:
            print(f"  unreadable: {r['error']} (fleet reset --key removes it)", file=out)
            continue
        print(f"  lowest fraction: {r['rung']}   updated {r['updated'] or '?'}   {len(r['ooms'])} OOM(s)", file=out)
        if r["points"]:
            kept = "" if r["kept"] is None else f"; a climb kept {r['kept']:g}"
            shown = ", ".join(f"{p['fraction']:g}: {p['kv_tokens']:,} KV tokens" for p in r["points"])
            print(f"  memory model: {shown}{kept}", file=out)
        for o in r["ooms"]:
            step = f"{o['fraction']:g} -> " + ("gave up" if o["next_fraction"] is None else f"{o['next_fraction']:g}")
            print(f"  {o['when'] or '?'}  {step}  {o['cause']}  on {o['host'] or '?'}/{o['server'] or '?'} "
                  f"({o['config'] or '?'})", file=out)
    return 0


async def _reset(client: Any, prefix: str, key: str | None, *, out: IO[str]) -> int:
    if key is None:
        count = await client.delete_prefix(prefix)
        print(f"fleet reset: deleted {count} record(s) under {prefix}", file=out)
        return 0
    if not await client.delete(key):
        return fail(f"fleet reset: no record at {key} (fleet list prints the keys)", EXIT_FAILED)
    print(f"fleet reset: deleted the record {key}", file=out)
    return 0
