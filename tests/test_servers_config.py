"""Several servers in one daemon's config: ``[[server]]`` entries, each a whole config of its
own (its GPUs, port, ladder, state directory), and what they must not share."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from supervisor.core.config import ConfigError, load_config, select_server, server_configs, unit_name
from supervisor.core.ownership import gpu_env, server_env

TWO = """
[state]
dir = "/var/lib/sglang-supervisor/kimi"

[policy]
fraction_ladder = [0.93, 0.88, 0.85]
backoff_initial_s = 5.0

[gpu]
backend = "nvml"
headroom_min_gb = 3.0

[router]
enabled = true
url = "http://127.0.0.1:30080"

[[server]]
name = "tp4-a"
model_path = "moonshotai/Kimi-K2.5"
port = 30001
tp_size = 4

[server.gpu]
indices = [0, 1, 2, 3]

[[server]]
name = "tp4-b"
model_path = "moonshotai/Kimi-K2.5"
port = 30002
tp_size = 4

[server.gpu]
indices = [4, 5, 6, 7]

[server.policy]
fraction_ladder = [0.90, 0.85]

[server.router]
worker_url = "http://10.0.0.5:30002"
"""


def write(tmp_path: Path, text: str, name: str = "kimi") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(textwrap.dedent(text))
    path.chmod(0o644)
    return path


def test_each_server_entry_is_a_whole_config_over_the_shared_sections(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, TWO))
    a, b = server_configs(cfg)
    assert [unit_name(a), unit_name(b)] == ["tp4-a", "tp4-b"]
    assert (a.server.port, b.server.port) == (30001, 30002)
    assert (a.gpu.indices, b.gpu.indices) == ((0, 1, 2, 3), (4, 5, 6, 7))
    # per-server tables lie key by key over the top-level ones
    assert a.policy.fraction_ladder == (0.93, 0.88, 0.85) and b.policy.fraction_ladder == (0.90, 0.85)
    assert a.policy.backoff_initial_s == b.policy.backoff_initial_s == 5.0
    assert a.gpu.backend == b.gpu.backend == "nvml" and b.gpu.headroom_min_gb == 3.0
    # each its own learned state, in a directory of its own under the daemon's
    assert a.state.dir == "/var/lib/sglang-supervisor/kimi/tp4-a"
    assert b.state.dir == "/var/lib/sglang-supervisor/kimi/tp4-b"
    assert cfg.state.dir == "/var/lib/sglang-supervisor/kimi"
    # the router's address is the daemon's; how it reaches each server is the server's
    assert a.router.url == b.router.url == "http://127.0.0.1:30080"
    assert b.router.worker_url == "http://10.0.0.5:30002" and a.router.worker_url == ""
    assert a.name == b.name == cfg.name == "kimi"


def test_a_single_server_table_is_still_one_server_named_after_the_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[server]\nmodel_path = "m"\n[state]\ndir = "/tmp/s"\n', name="solo"))
    (only,) = server_configs(cfg)
    assert only is cfg and unit_name(only) == "solo" and cfg.units == ()
    assert only.state.dir == "/tmp/s"


def test_select_server_picks_one_by_name_and_names_the_known_ones_otherwise(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, TWO))
    assert [unit_name(u) for u in select_server(cfg, "tp4-b")] == ["tp4-b"]
    assert len(select_server(cfg, None)) == 2
    with pytest.raises(ConfigError, match=r"--server 'c': no such server in kimi \(known: tp4-a, tp4-b\)"):
        select_server(cfg, "c")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("port = 30002", "port = 30001"), "servers 'tp4-a' and 'tp4-b' have the same port 30001"),
        (('name = "tp4-b"', 'name = "tp4-a"'), "servers '#1' and '#2' have the same name tp4-a"),
        (("indices = [4, 5, 6, 7]", "indices = [3, 4, 5, 6]"), "servers 'tp4-a' and 'tp4-b' have the same GPU index 3"),
        (('name = "tp4-b"\n', ""), r"\[\[server\]\] #2: name: missing"),
        (('name = "tp4-b"', 'name = "tp4 b"'), "must be a name of letters"),
        (('worker_url = "http://10.0.0.5:30002"', 'url = "http://x:1"'),
         r"\[server.router\] url: not set per server \(per server: worker_url"),
        (("[server.gpu]\nindices = [4, 5, 6, 7]", ""), r"server 'tp4-b': \[server.gpu\] indices: missing"),
        (("port = 30002", "port = 0"), r"server 'tp4-b': \[server\] port = 0: must be an integer 1..65535"),
        (("fraction_ladder = [0.90, 0.85]", "fraction_ladder = [0.85, 0.90]"),
         r"server 'tp4-b': \[policy\] fraction_ladder = \[0.85, 0.9\]: must be a non-empty, strictly decreasing"),
    ],
)
def test_what_servers_must_not_share_or_miss_is_one_line_naming_them(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    old, new = change
    assert TWO.count(old) == 1
    text = TWO.replace(old, new)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(write(tmp_path, text))
    assert "\n" not in str(err.value)


def test_an_empty_server_array_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[\[server\]\]: empty"):
        load_config(write(tmp_path, "server = []\n"))


def test_the_gpus_are_exported_as_cuda_visible_devices_and_win_over_the_daemons_environment() -> None:
    environ = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    env = server_env(("PATH", "CUDA_*"), {"X": "1", **gpu_env((4, 5, 6, 7))}, environ, {"MARK": "m"})
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # NVML's order, so index 4 is the same card to both
    assert env["X"] == "1" and env["MARK"] == "m" and env["PATH"] == "/usr/bin"
    # no indices: the daemon's own CUDA_VISIBLE_DEVICES passes through as before
    assert server_env(("CUDA_*",), gpu_env(()), environ)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


def test_env_cuda_visible_devices_beside_gpu_indices_is_refused(tmp_path: Path) -> None:
    text = '[server]\nmodel_path = "m"\nenv = { CUDA_VISIBLE_DEVICES = "1" }\n[gpu]\nindices = [0]\n'
    with pytest.raises(ConfigError, match="env CUDA_VISIBLE_DEVICES: must not be set with"):
        load_config(write(tmp_path, text))
