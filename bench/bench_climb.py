"""The climb (issue 25, docs/capacity.md): from "stable" to serving at the higher fraction.

One simulated server alone (`[policy] climb = true`, any time of day) starts at 0.80 under
KV pressure: a 3,000-token pool (`--max-total-tokens`) and 12 clients sending 10-word
prompts for 500 new tokens, so decode keeps running out of KV tokens and SGLang's 0.5.23
retraction line keeps coming. Each time it has been READY for `stable_after_s` with that
pressure seen, the daemon climbs: a drained restart at a higher fraction. The first climb is
one step (the model knows one fraction), the second goes to f* (about 0.90 on these 96 GB
simulated cards); then f* is where it runs and it stays. Per climb:

- decided: the `stable` event of that launch -> the `climb` event (the next pressure signal);
- serving again: the `climb` event -> `server_ready` at the higher fraction (the drain of the
  requests in flight, the release of the GPUs, the launch and the start of the new server).
  SGLang 0.5.23 keeps accepting requests while it drains, so a server alone climbs in a quiet
  window: the clients send nothing new from the climb until the server is ready again;
- the sum of both: from "stable" to "serving at the higher fraction".
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

from .common import Daemon, Row, Section, Settings, Stat, daemon_sections, event_is, reap_tagged, simulator, wait_until

CLIENTS = 12
LADDER = [0.93, 0.88, 0.85, 0.82, 0.80]


def _clients(port: int, stop: threading.Event, pause: threading.Event) -> list[threading.Thread]:
    body = json.dumps({"text": "one two three four five six seven eight nine ten",
                       "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}).encode()

    def run() -> None:
        while not stop.is_set():
            if pause.is_set():
                time.sleep(0.05)
                continue
            req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
            except Exception:  # noqa: BLE001 - a restart refuses connections for a moment
                time.sleep(0.2)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    return threads


def run(settings: Settings) -> Section:
    climbs_wanted = 1 if settings.quick else 2
    decided: list[float] = []
    serving: list[float] = []
    total: list[float] = []
    for r in range(settings.repeats):
        work = settings.dir(f"climb-{r}")
        sim = simulator("--sim-load-s", "0.2", "--sim-drain-poll-s", "0.25", "--max-total-tokens", "3000")
        sections = daemon_sections(settings, work, sim, {
            "server": {"mem_fraction_static": 0.80, "stop_grace_s": 30.0},
            "health": {"interval_s": 1.0},
            "policy": {"climb": True, "climb_window": "", "stable_after_s": 2.0, "climb_interval_s": 1.0,
                       "probation_s": 1.0, "fraction_ladder": LADDER},
        })
        port = int(sections["server"]["port"])  # type: ignore[call-overload]
        daemon = Daemon(settings, work, sections)
        stop, pause = threading.Event(), threading.Event()
        try:
            daemon.wait_for(event_is("server_ready"), 120, "the server ready")
            threads = _clients(port, stop, pause)
            for n in range(1, climbs_wanted + 1):
                # SGLang 0.5.23 accepts new requests while it drains: a server alone climbs in a
                # quiet window, so the clients stop sending at the climb; what is in flight drains
                wait_until(lambda d=daemon, n=n: len(d.monos(event_is("climb"))) >= n, 120, f"climb {n}")
                pause.set()
                daemon.wait_for(lambda e, n=n: e.get("event") == "server_ready" and e.get("attempt") == n + 1, 120,
                                f"climb {n} serving")
                pause.clear()
            stop.set()
            for t in threads:
                t.join(40)
            events = daemon.events()
        finally:
            stop.set()
            daemon.stop()
            reap_tagged(settings.tag)
        climbs = [e for e in events if e.get("event") == "climb"]
        for c in climbs:
            stable = [e["mono"] for e in events if e.get("event") == "stable" and e["mono"] <= c["mono"]]
            ready = next((e for e in events if e.get("event") == "server_ready" and e["mono"] > c["mono"]), None)
            if not stable or ready is None or ready.get("mem_fraction_static") != c["mem_fraction_static"]:
                continue
            decided.append(c["mono"] - stable[-1])
            serving.append(ready["mono"] - c["mono"])
            total.append(ready["mono"] - stable[-1])
    section = Section("climb", raw={"decided_s": decided, "serving_again_s": serving, "total_s": total,
                                    "clients": CLIENTS})
    note = (f"a simulated server alone under KV pressure ({CLIENTS} clients, a 3,000-token pool), "
            f"{len(total)} climbs over {settings.repeats} runs")
    section.rows += [
        Row("climb_decided", "stable → climb decided, p50", "ms", _ms(decided), note=note),
        Row("climb_serving", "climb → serving at the higher fraction (drain + relaunch), p50", "s", Stat.of(serving)),
        Row("climb_total", "stable → serving at the higher fraction, p50", "s", Stat.of(total)),
    ]
    return section


def _ms(values: list[float]) -> Stat:
    return Stat.of([v * 1000 for v in values])


if __name__ == "__main__":
    import tempfile
    import uuid

    s = Settings(quick=False, repeats=1, work=Path(tempfile.mkdtemp(prefix="sgl-bench-climb-")), tag=uuid.uuid4().hex)
    for row in run(s).rows:
        print(row.key, row.ours)
