"""The daemon's ``stop`` and ``start`` over its control socket (issue 33), on fake ports
(tests/test_daemon_component.py's ``Rig``): the server drained and held while the daemon
stays up, what is refused and why, and the lines a waiting ``stop``/``start`` reads."""

from __future__ import annotations

import asyncio
import signal

from test_daemon_component import DEADLINE_S, Rig

from supervisor.adapters.ports import ControlReply
from supervisor.core.model import State


async def lines(reply: object) -> list[dict[str, object]]:
    assert isinstance(reply, ControlReply)
    try:
        return [line async for line in reply.then]
    finally:
        reply.close()


async def serving(tmp_path) -> Rig:
    """A daemon on fake ports whose server is READY."""
    rig = Rig(tmp_path)
    rig.prober.default = True
    rig.start()
    await rig.until(lambda: rig.state() is State.READY, "READY")
    return rig


async def test_stop_drains_and_holds_while_the_daemon_stays_up_then_start_brings_it_back(tmp_path):
    async with asyncio.timeout(DEADLINE_S):
        rig = await serving(tmp_path)
        refused = rig.daemon._on_control({"cmd": "start", "server": rig.daemon.units[0].name})
        assert refused["ok"] is False and "not stopped by an operator" in str(refused["error"])
        nothing = rig.daemon._on_control({"cmd": "start"})
        assert nothing["ok"] is False and "nothing to start" in str(nothing["error"])

        reply = rig.daemon._on_control({"cmd": "stop", "reason": "GPU 3 reseated", "wait": True})
        assert isinstance(reply, ControlReply) and reply.answer["ok"]
        followed = await lines(reply)
        assert [x.get("state") for x in followed if "state" in x][-1] == "STOPPED"  # each state it was seen in
        assert followed[-1]["done"] and followed[-1]["ok"], followed
        assert rig.spawner.servers[0].stopped_with == [signal.SIGTERM]  # a drain
        assert rig.state() is State.STOPPED and not rig.task.done()  # the daemon stays up
        assert rig.sink.find("server_held") and not rig.sink.find("crash")
        assert rig.store.saves[-1]["held"]["reason"] == "GPU 3 reseated"
        again = rig.daemon._on_control({"cmd": "restart", "server": rig.daemon.units[0].name})
        assert again["ok"] is False and "start --server" in str(again["error"])

        reply = rig.daemon._on_control({"cmd": "start", "wait": True})
        followed = await lines(reply)
        assert followed[-1]["done"] and followed[-1]["ok"], followed
        assert rig.state() is State.READY and len(rig.spawner.servers) == 2
        assert rig.sink.find("server_released") and rig.store.saves[-1]["held"] is None
        assert await rig.stop() == 0


async def test_stop_of_an_unknown_server_and_while_stopping_are_refused(tmp_path):
    async with asyncio.timeout(DEADLINE_S):
        rig = await serving(tmp_path)
        unknown = rig.daemon._on_control({"cmd": "stop", "server": "nope"})
        assert unknown["ok"] is False and "no server 'nope'" in str(unknown["error"])
        assert rig.daemon._on_control({"cmd": "stop"})["ok"]
        await rig.until(lambda: rig.state() is State.STOPPING, "STOPPING")
        busy = rig.daemon._on_control({"cmd": "stop"})
        assert busy["ok"] is False and "already stopping" in str(busy["error"])
        await rig.until(lambda: rig.state() is State.STOPPED, "held")
        assert await rig.stop() == 0  # a held server: the daemon's stop ends it


async def test_the_first_launch_loads_the_diagnosis_tables_off_the_crash_path(tmp_path):
    from supervisor.core.diagnosis.catalogue import catalogue

    async with asyncio.timeout(DEADLINE_S):
        rig = await serving(tmp_path)
        await rig.until(lambda: not [t for t in rig.daemon.tasks.tasks() if t.get_name() == "warm-diagnosis"],
                        "the tables loaded")
        assert rig.daemon._warmed and catalogue.cache_info().currsize == 1
        assert await rig.stop() == 0
