"""Unit tests of the configuration (issue 2, item 2): every section's bad values, wrong types,
unknown keys and sections, ``--set`` overrides, file-level failures (encoding, TOML syntax,
unreadable, group/other-writable), the shipped example files, and ``build_argv``.

Every rejection must be a ``ConfigError`` whose text is one line naming the key, the value
and the rule.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.argv import build_argv
from supervisor.core.config import (
    DEFAULT_LADDER,
    Config,
    ConfigError,
    build_config,
    check_file_mode,
    config_from_overrides,
    load_config,
    parse_override,
)

REPO = Path(__file__).resolve().parent.parent
MODEL = 'model_path = "moonshotai/Kimi-K2.5"'


def parse(text: str) -> Config:
    """Validate a TOML document whose [server] section already has a model path."""
    return build_config(tomllib.loads(text), where="t.toml")


def rejects(text: str) -> str:
    """The one-line message of the ConfigError raised for ``text``."""
    with pytest.raises(ConfigError) as info:
        parse(text)
    message = str(info.value)
    assert "\n" not in message and message.startswith("t.toml: ")
    return message


def with_key(section: str, key: str, literal: str) -> str:
    """A minimal valid document with ``key = literal`` set in ``section``."""
    if section == "server":
        model = "" if key == "model_path" else f"{MODEL}\n"
        return f"[server]\n{model}{key} = {literal}\n"
    return f"[server]\n{MODEL}\n[{section}]\n{key} = {literal}\n"


def write(path: Path, data: bytes | str, mode: int = 0o644) -> Path:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(mode)
    return path


# --- bad values, section by section ----------------------------------------------------------

BAD_VALUES = [
    ("server", "command", "[]", "non-empty list of strings"),
    ("server", "model_path", '""', "non-empty string"),
    ("server", "host", '""', "host name or address"),
    ("server", "port", "0", "1..65535"),
    ("server", "port", "65536", "1..65535"),
    ("server", "tp_size", "0", ">= 1"),
    ("server", "dp_size", "-1", ">= 1"),
    ("server", "mem_fraction_static", "1.0", "between 0 and 1"),
    ("server", "mem_fraction_static", "0", "between 0 and 1"),
    ("server", "hicache_size_gb", "-8", ">= 0"),
    ("server", "stop_grace_s", "0", "> 0"),
    ("health", "path", '"health"', "starting with /"),
    ("health", "interval_s", "0", "> 0"),
    ("health", "timeout_s", "-30", "> 0"),
    ("health", "failures", "0", ">= 1"),
    ("health", "startup_timeout_s", "0", "> 0"),
    ("health", "startup_poll_s", "-1", "> 0"),
    ("policy", "fraction_ladder", "[]", "strictly decreasing"),
    ("policy", "fraction_ladder", "[0.80, 0.88]", "strictly decreasing"),
    ("policy", "fraction_ladder", "[0.93, 0.93]", "strictly decreasing"),
    ("policy", "fraction_ladder", "[1.2, 0.9]", "between 0 and 1"),
    ("policy", "backoff_initial_s", "-1", ">= 0"),
    ("policy", "backoff_factor", "0.5", ">= 1"),
    ("policy", "backoff_max_s", "-1", ">= 0"),
    ("policy", "backoff_jitter", "1.5", "between 0 and 1"),
    ("policy", "stable_after_s", "0", "> 0"),
    ("policy", "max_crashes", "0", ">= 1"),
    ("policy", "crash_window_s", "0", "> 0"),
    ("policy", "hicache_min_gb", "0", ">= 1"),
    ("gpu", "backend", '"cuda"', '"nvml", "simulated", "none"'),
    ("gpu", "indices", "[0, -1]", ">= 0"),
    ("gpu", "interval_s", "0", "> 0"),
    ("gpu", "call_timeout_s", "0", "> 0"),
    ("gpu", "free_share_min", "1.5", "between 0 and 1"),
    ("gpu", "release_timeout_s", "0", "> 0"),
    ("gpu", "low_free_warn_gb", "-1", ">= 0"),
    ("gpu", "headroom_min_gb", "-0.5", ">= 0"),
    ("gpu", "headroom_action", '"kill"', '"step_down", "warn"'),
    ("gpu", "host_ram_margin_gb", "-1", ">= 0"),
    ("metrics", "listen", '"9188"', "HOST:PORT"),
    ("metrics", "listen", '"127.0.0.1:99999"', "HOST:PORT"),
    ("metrics", "listen", '":9188"', "HOST:PORT"),
    ("mqtt", "port", "0", "1..65535"),
    ("mqtt", "keepalive_s", "0", ">= 1"),
    ("mqtt", "qos", "3", "0, 1 or 2"),
    ("mqtt", "topic_prefix", '"alerts/#"', "without wildcards"),
    ("mqtt", "topic_prefix", '""', "without wildcards"),
    ("mqtt", "outbox_size", "0", ">= 1"),
    ("mqtt", "connect_timeout_s", "0", "> 0"),
    ("mqtt", "reconnect_initial_s", "0", "> 0"),
    ("mqtt", "reconnect_max_s", "-1", "> 0"),
    ("mqtt", "evidence_max_chars", "79", ">= 80"),
    ("logging", "format", '"xml"', '"auto", "json", "console"'),
    ("logging", "level", '"trace"', '"debug", "info", "warning", "error"'),
    ("logging", "server_log_max_bytes", "4095", ">= 4096"),
    ("logging", "server_log_backups", "-1", ">= 0"),
    ("logging", "tail_bytes", "100", ">= 4096"),
    ("state", "dir", '""', "a directory path"),
]


@pytest.mark.parametrize(("section", "key", "literal", "rule"), BAD_VALUES,
                         ids=[f"{s}.{k}={v}" for s, k, v, _ in BAD_VALUES])
def test_bad_value_names_key_value_and_rule(section: str, key: str, literal: str, rule: str) -> None:
    """A value outside its rule is refused with '[section] key = value: must be rule'."""
    message = rejects(with_key(section, key, literal))
    value = tomllib.loads(f"v = {literal}")["v"]
    assert f"[{section}] {key} = {value!r}: must be " in message
    assert rule in message


WRONG_TYPES = [
    ("server", "port", "true", "1..65535"),  # bool is not an int
    ("server", "port", "30000.0", "1..65535"),  # no silent float -> int
    ("server", "tp_size", '"8"', ">= 1"),  # string for number
    ("server", "hicache_size_gb", "1.5", ">= 0"),
    ("server", "mem_fraction_static", '"0.9"', "between 0 and 1"),
    ("server", "mem_fraction_static", "nan", "between 0 and 1"),
    ("server", "model_path", "1", "non-empty string"),
    ("server", "command", '"python -m sglang.launch_server"', "list of strings"),
    ("server", "extra_args", '["--trust-remote-code", 1]', "a list of strings"),
    ("server", "env", "{ NCCL_DEBUG = 1 }", "a table of strings"),
    ("server", "env", '"NCCL_DEBUG=WARN"', "a table of strings"),
    ("health", "interval_s", '"10"', "> 0"),
    ("health", "interval_s", "true", "> 0"),
    ("health", "interval_s", "nan", "> 0"),
    ("health", "interval_s", "inf", "> 0"),
    ("health", "timeout_s", "-inf", "> 0"),
    ("policy", "fraction_ladder", "[0.93, nan]", "strictly decreasing"),
    ("policy", "fraction_ladder", '[0.93, "0.88"]', "strictly decreasing"),
    ("policy", "backoff_factor", "inf", ">= 1"),
    ("policy", "max_crashes", "5.0", ">= 1"),
    ("gpu", "kill_foreign", '"yes"', "true or false"),
    ("gpu", "kill_foreign", "1", "true or false"),
    ("gpu", "indices", "0", ">= 0"),
    ("metrics", "enabled", "1", "true or false"),
    ("mqtt", "tls", '"true"', "true or false"),
    ("mqtt", "qos", "1.0", "0, 1 or 2"),
]


@pytest.mark.parametrize(("section", "key", "literal", "rule"), WRONG_TYPES,
                         ids=[f"{s}.{k}={v}" for s, k, v, _ in WRONG_TYPES])
def test_wrong_type_is_refused_not_cast(section: str, key: str, literal: str, rule: str) -> None:
    """Booleans for integers, strings for numbers, NaN and infinities are refused, never cast."""
    message = rejects(with_key(section, key, literal))
    assert f"[{section}] {key} = " in message and rule in message


def test_long_values_are_shortened_in_the_message() -> None:
    """A huge bad value does not flood the one-line error."""
    message = rejects(with_key("health", "path", '"' + "x" * 500 + '"'))
    assert "..." in message and len(message) < 200


def test_unknown_key_is_refused_with_the_known_keys() -> None:
    """A misspelt key names itself and lists the keys of its section."""
    message = rejects(with_key("server", "mem_fraction", "0.9"))
    assert "[server] mem_fraction: unknown key" in message
    assert "mem_fraction_static" in message


def test_unknown_section_is_refused_with_the_known_sections() -> None:
    """A misspelt section names itself and lists the real ones."""
    message = rejects(f"[server]\n{MODEL}\n[alerts]\nenabled = true\n")
    assert "[alerts]: unknown section" in message and "[mqtt]" in message


@pytest.mark.parametrize(
    ("section", "key", "suggestion"),
    [
        ("server", "mem_fraction", "'mem_fraction_static'"),
        ("server", "mem_fraction_statc", "'mem_fraction_static'"),
        ("policy", "backof_max_s", "'backoff_max_s'"),
        ("mqtt", "hostname", "'host'"),
    ],
)
def test_unknown_key_suggests_the_closest_known_one(section: str, key: str, suggestion: str) -> None:
    """A misspelt key gets "did you mean" the closest key of its section, on the same line."""
    message = rejects(with_key(section, key, "1"))
    assert f"[{section}] {key}: unknown key; did you mean {suggestion}?" in message


def test_unknown_key_far_from_every_known_one_gets_no_suggestion() -> None:
    """No guess when nothing is close: the list of known keys says the rest."""
    message = rejects(with_key("server", "zzzzzz", "1"))
    assert "did you mean" not in message and "(known: " in message


def test_unknown_section_suggests_the_closest_known_one() -> None:
    """[metric] gets "did you mean [metrics]?" on the same line."""
    message = rejects(f"[server]\n{MODEL}\n[metric]\nenabled = true\n")
    assert "[metric]: unknown section; did you mean [metrics]?" in message


def test_section_that_is_not_a_table_is_refused() -> None:
    """``health = 3`` instead of a [health] table is refused."""
    message = rejects(f"health = 3\n[server]\n{MODEL}\n")
    assert "[health] must be a table" in message


def test_name_is_not_a_config_key() -> None:
    """The internal ``name`` field cannot be set from TOML."""
    assert "[name]: unknown section" in rejects(f'name = "x"\n[server]\n{MODEL}\n')


# --- cross-key rules --------------------------------------------------------------------------


def test_model_path_is_required() -> None:
    """An empty file is refused: the model path has no default."""
    assert "[server] model_path: missing" in rejects("")


def test_fraction_below_the_ladder_floor_is_refused() -> None:
    """A starting fraction under the ladder's floor could never be stepped down from."""
    message = rejects(with_key("server", "mem_fraction_static", "0.7"))
    assert "[server] mem_fraction_static = 0.7" in message and "floor 0.8" in message


def test_simulated_backend_needs_a_sim_dir() -> None:
    """backend = "simulated" without sim_dir is refused."""
    assert "[gpu] sim_dir" in rejects(with_key("gpu", "backend", '"simulated"'))


def test_mqtt_username_needs_a_password_file() -> None:
    """A username without a password file is refused: passwords are never inline."""
    text = f'[server]\n{MODEL}\n[mqtt]\nenabled = true\nusername = "sup"\n'
    assert "[mqtt] password_file" in rejects(text)


@pytest.mark.parametrize(
    ("host", "words"),
    [("mqtt://broker.internal:1883", 'without a scheme ("mqtt://")'),
     ("broker.internal:1883", "the port goes in port (host = 'broker.internal', port = 1883)"),
     ("broker internal", "no spaces"), ("broker/alerts", "no path")],
)
def test_mqtt_host_is_a_bare_host(host: str, words: str) -> None:
    """A URL or HOST:PORT in [mqtt] host is refused, saying where the port goes."""
    message = rejects(with_key("mqtt", "host", f'"{host}"'))
    assert f"[mqtt] host = {host!r}: must be" in message and words in message


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "fd00::10", "localhost", "mqtt.corp.internal", "examples.net"])
def test_mqtt_host_accepts_names_and_addresses(host: str) -> None:
    """Names, IPv4 and IPv6 addresses (colons and all), and localhost are hosts."""
    assert parse(with_key("mqtt", "host", f'"{host}"') + "enabled = true\n").mqtt.host == host


@pytest.mark.parametrize(
    "host", ["broker.example", "mqtt.internal.example", "example.com", "mqtt.example.org", "EXAMPLE.NET.",
             "broker.test", "x.invalid"],
)
def test_mqtt_placeholder_host_is_refused_when_enabled(host: str) -> None:
    """A name reserved for examples (RFC 2606/6761) with MQTT on is a sample left in: refused,
    naming the family; with MQTT off it is left alone."""
    message = rejects(with_key("mqtt", "host", f'"{host}"') + "enabled = true\n")
    assert "a placeholder" in message and "RFC 2606/6761" in message and "enabled = false" in message
    assert parse(with_key("mqtt", "host", f'"{host}"')).mqtt.host == host


def _mqtt_on(tmp_path: Path, password_file: Path) -> Path:
    return write(tmp_path / "m.toml", f'[server]\n{MODEL}\n[mqtt]\nenabled = true\nhost = "10.0.0.5"\n'
                                      f'username = "u"\npassword_file = "{password_file}"\n')


def test_mqtt_password_file_must_exist(tmp_path: Path) -> None:
    """A password file that is not there is refused at check-config, not at the first alert."""
    missing = tmp_path / "nope.pw"
    with pytest.raises(ConfigError) as info:
        load_config(_mqtt_on(tmp_path, missing))
    assert str(info.value) == (f"{tmp_path / 'm.toml'}: [mqtt] password_file = {str(missing)!r}: "
                               "cannot read it: No such file or directory")


@pytest.mark.parametrize(("mode", "refused"), [(0o644, True), (0o604, True), (0o640, False), (0o600, False)])
def test_mqtt_password_file_readable_by_others_is_refused(tmp_path: Path, mode: int, refused: bool) -> None:
    """Others may not read the broker's password; the group may (the service's group)."""
    pw = write(tmp_path / "mqtt.pw", "hunter2\n", mode)
    if not refused:
        assert load_config(_mqtt_on(tmp_path, pw)).mqtt.password_file == str(pw)
        return
    with pytest.raises(ConfigError) as info:
        load_config(_mqtt_on(tmp_path, pw))
    assert f"readable by others (mode {mode:04o})" in str(info.value) and f"chmod o-r {pw}" in str(info.value)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "arg",
    ["--mem-fraction-static", "--mem-fraction-static=0.9", "--mem-frac", "--tp", "--tp-size",
     "--tensor-parallel-size=8", "--dp", "--port", "--host=0.0.0.0", "--model", "--hicache-size",
     "--enable-hierarchical-cache", "--enable-hicache"],
)
def test_extra_args_must_not_set_a_flag_the_supervisor_manages(arg: str) -> None:
    """extra_args cannot override a managed flag (SGLang keeps the last one, so the ladder
    would be silently ignored), not even as an abbreviation or ``--flag=value``."""
    message = rejects(with_key("server", "extra_args", f'["--trust-remote-code", "{arg}", "0.9"]'))
    assert "[server] extra_args = " in message and f"must not contain {arg!r}" in message


def test_extra_args_may_set_other_flags() -> None:
    """Flags the supervisor does not manage pass, including ones that share a prefix."""
    args = '["--trust-remote-code", "--hicache-ratio", "2", "--model-loader-extra-config", "{}", "--"]'
    assert len(parse(with_key("server", "extra_args", args)).server.extra_args) == 6


def test_defaults_are_valid() -> None:
    """A file with only the model path is a complete, valid config."""
    cfg = parse(f"[server]\n{MODEL}\n")
    assert cfg.server.port == 30000 and cfg.policy.fraction_ladder == DEFAULT_LADDER
    assert cfg.server.mem_fraction_static is None
    assert cfg.metrics.listen.startswith("127.0.0.1:")


def test_integers_are_accepted_for_numbers() -> None:
    """``interval_s = 10`` is a number: ints widen to float (the reverse is refused)."""
    cfg = parse(with_key("health", "interval_s", "10"))
    assert cfg.health.interval_s == 10.0 and isinstance(cfg.health.interval_s, float)


# --- --set overrides --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("server.port=30001", ("server", "port", 30001)),
        ("server.mem_fraction_static=0.88", ("server", "mem_fraction_static", 0.88)),
        ("gpu.kill_foreign=true", ("gpu", "kill_foreign", True)),
        ('server.model_path="/models/kimi k2"', ("server", "model_path", "/models/kimi k2")),
        ("policy.fraction_ladder=[0.9, 0.85]", ("policy", "fraction_ladder", [0.9, 0.85])),
        ('server.env={ NCCL_DEBUG = "INFO" }', ("server", "env", {"NCCL_DEBUG": "INFO"})),
        ("state.dir=/tmp/x", ("state", "dir", "/tmp/x")),
        ("metrics.listen=127.0.0.1:9300", ("metrics", "listen", "127.0.0.1:9300")),
        ("server.model_path=moonshotai/Kimi-K2.5", ("server", "model_path", "moonshotai/Kimi-K2.5")),
        ("logging.server_log=", ("logging", "server_log", "")),
        ("server.host=a=b", ("server", "host", "a=b")),
    ],
)
def test_override_values_are_toml_and_bare_words_are_strings(
    text: str, expected: tuple[str, str, Any]
) -> None:
    """``--set`` reads the value as TOML; what is not TOML is taken as a plain string."""
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["server.port", "port=1", ".port=1", "server.=1", "=1"])
def test_malformed_override_is_refused(text: str) -> None:
    """An override must look like SECTION.KEY=VALUE."""
    with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
        parse_override(text)


def test_overrides_apply_on_top_of_the_file(tmp_path: Path) -> None:
    """load_config applies --set items after reading the file, then validates the result."""
    path = write(tmp_path / "kimi.toml", f"[server]\n{MODEL}\nport = 30000\n")
    cfg = load_config(path, ["server.port=30001", "state.dir=/tmp/kimi", "gpu.headroom_action=warn"])
    assert (cfg.server.port, cfg.state.dir, cfg.gpu.headroom_action) == (30001, "/tmp/kimi", "warn")
    assert cfg.name == "kimi"


def test_overrides_are_validated_like_the_file(tmp_path: Path) -> None:
    """A bad --set value fails with the same one-line rule message."""
    path = write(tmp_path / "kimi.toml", f"[server]\n{MODEL}\n")
    with pytest.raises(ConfigError, match=r"\[server\] port = 'x': must be an integer 1..65535"):
        load_config(path, ["server.port='x'"])
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(path, ["serve.port=1"])


def test_override_into_a_non_table_is_refused(tmp_path: Path) -> None:
    """--set health.x=1 when the file has ``health = 3`` says so instead of crashing."""
    path = write(tmp_path / "kimi.toml", f"health = 3\n[server]\n{MODEL}\n")
    with pytest.raises(ConfigError, match=r"\[health\] is not a table"):
        load_config(path, ["health.interval_s=1"])


def test_config_from_overrides_alone() -> None:
    """The demo builds a config from --set items only."""
    cfg = config_from_overrides(["server.model_path=m", "server.port=31001"])
    assert (cfg.server.model_path, cfg.server.port, cfg.name) == ("m", 31001, "demo")


# --- the file -------------------------------------------------------------------------------


def test_file_not_utf8_is_refused(tmp_path: Path) -> None:
    """Latin-1 bytes give a one-line error with the byte offset."""
    path = write(tmp_path / "c.toml", b'[server]\nmodel_path = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 26\)"):
        load_config(path)


def test_invalid_toml_is_refused(tmp_path: Path) -> None:
    """A TOML syntax error is reported with its line, as one line."""
    path = write(tmp_path / "c.toml", "[server\nmodel_path = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML") as info:
        load_config(path)
    assert "\n" not in str(info.value) and "line 1" in str(info.value)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    """A path that does not exist cannot be read."""
    with pytest.raises(ConfigError, match="cannot read: No such file"):
        load_config(tmp_path / "absent.toml")


def test_unreadable_file_is_refused(tmp_path: Path) -> None:
    """A path that cannot be read (a directory: refused even to root) is a ConfigError."""
    (tmp_path / "c.toml").mkdir()
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "c.toml")


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666, 0o620])
def test_group_or_other_writable_file_is_refused(tmp_path: Path, mode: int) -> None:
    """The file sets a command line: anyone but the owner able to write it is refused."""
    path = write(tmp_path / "c.toml", f"[server]\n{MODEL}\n", mode)
    with pytest.raises(ConfigError, match=f"writable by group or others \\(mode {mode:04o}\\)"):
        load_config(path)
    with pytest.raises(ConfigError, match="chmod go-w"):
        check_file_mode(path)


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o400])
def test_owner_only_writable_file_is_accepted(tmp_path: Path, mode: int) -> None:
    """Modes that only the owner can write pass the check."""
    path = write(tmp_path / "c.toml", f"[server]\n{MODEL}\n", mode)
    assert load_config(path).server.model_path == "moonshotai/Kimi-K2.5"


def _shipped(tmp_path: Path, name: str) -> Path:
    """A copy of etc/NAME with mode 0644 (a checkout under umask 002 would be group-writable)."""
    copy = tmp_path / name
    shutil.copyfile(REPO / "etc" / name, copy)
    copy.chmod(0o644)
    return copy


def test_example_config_loads(tmp_path: Path) -> None:
    """etc/supervisor.example.toml is valid and says what its comments say."""
    cfg = load_config(_shipped(tmp_path, "supervisor.example.toml"))
    assert (cfg.server.tp_size, cfg.server.dp_size, cfg.server.hicache_size_gb) == (8, 1, 48)
    assert cfg.server.mem_fraction_static == 0.93
    assert cfg.policy.fraction_ladder == DEFAULT_LADDER
    assert cfg.health.timeout_s > 20  # above SGLang's own /health timeout
    assert cfg.metrics.listen.startswith("127.0.0.1:")
    assert not cfg.mqtt.enabled  # shipped off: its broker is the user's to name (commented lines say how)


def test_shipped_example_passes_check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`check-config` on the shipped example as it is: exit 0, "ok"; turned on as its comments
    show but with the sample's placeholder host left in: one line, exit 2."""
    from supervisor.cli import main

    example = _shipped(tmp_path, "supervisor.example.toml")
    assert main(["check-config", "--config", str(example)]) == 0
    assert capsys.readouterr().out.strip() == f"{example}: ok"
    assert main(["check-config", "--config", str(example), "--set", "mqtt.enabled=true",
                 "--set", 'mqtt.host="mqtt.internal.example"']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[mqtt] host = 'mqtt.internal.example': a placeholder" in err


def test_demo_config_loads(tmp_path: Path) -> None:
    """supervisor/sim/demo.toml is valid and runs the simulator on the simulated GPU backend."""
    copy = tmp_path / "demo.toml"
    shutil.copyfile(REPO / "supervisor" / "sim" / "demo.toml", copy)
    copy.chmod(0o644)
    cfg = load_config(copy)
    assert cfg.gpu.backend == "simulated"
    assert cfg.server.command[1:3] == ("-m", "supervisor.sim.simulator")
    assert not cfg.mqtt.enabled


# --- build_argv -------------------------------------------------------------------------------


def _argv(fraction: float = 0.93, hicache: int = 0, **server: Any) -> tuple[str, ...]:
    data = {"server": {"model_path": "moonshotai/Kimi-K2.5", **server}}
    return build_argv(build_config(data), fraction, hicache)


def test_build_argv_spells_flags_as_sglang_does() -> None:
    """Prefix, then the flags SGLang's parser knows, then extra_args last."""
    argv = _argv(0.88, 0, tp_size=8, port=30001, extra_args=["--trust-remote-code"])
    assert argv == (
        "python", "-m", "sglang.launch_server",
        "--model-path", "moonshotai/Kimi-K2.5",
        "--host", "127.0.0.1",
        "--port", "30001",
        "--tp-size", "8",
        "--mem-fraction-static", "0.88",
        "--trust-remote-code",
    )


def test_build_argv_never_uses_the_tp_abbreviation() -> None:
    """--tp only works by argparse prefix matching: always --tp-size."""
    argv = _argv(tp_size=8)
    assert "--tp" not in argv and "--dp" not in argv
    assert argv[argv.index("--tp-size") + 1] == "8"


@pytest.mark.parametrize(("dp", "present"), [(1, False), (2, True)])
def test_build_argv_dp_size_only_when_above_one(dp: int, present: bool) -> None:
    """--dp-size appears only for data parallelism > 1."""
    argv = _argv(dp_size=dp)
    assert ("--dp-size" in argv) is present
    if present:
        assert argv[argv.index("--dp-size") + 1] == str(dp)


@pytest.mark.parametrize(("size", "present"), [(0, False), (48, True)])
def test_build_argv_hicache_only_when_positive(size: int, present: bool) -> None:
    """--enable-hierarchical-cache --hicache-size N appear together, only for N > 0."""
    argv = _argv(hicache=size)
    assert ("--enable-hierarchical-cache" in argv) is present
    assert ("--hicache-size" in argv) is present
    if present:
        i = argv.index("--enable-hierarchical-cache")
        assert argv[i + 1 : i + 3] == ("--hicache-size", str(size))


@pytest.mark.parametrize("fraction", [0.93, 0.88, 0.85, 0.82, 0.80, 0.875])
def test_build_argv_prints_the_fraction_exactly(fraction: float) -> None:
    """The fraction is printed short and exact (0.8, not 0.8000000000000002)."""
    argv = _argv(fraction)
    assert float(argv[argv.index("--mem-fraction-static") + 1]) == fraction
    assert len(argv[argv.index("--mem-fraction-static") + 1]) <= 5


def test_router_section() -> None:
    """[router]: off by default; on it needs a URL; the worker URL defaults to the server's
    address (a wildcard bind reached on loopback); bad values are one line."""
    base = f"[server]\n{MODEL}\nport = 30001\nhost = '0.0.0.0'\n"
    assert not parse(base).router.enabled
    cfg = parse(base + "[router]\nenabled = true\nurl = 'http://127.0.0.1:30080'\n")
    assert cfg.router.enabled and cfg.router.remove_wait_s == 5.0
    from supervisor.core.config import worker_url

    assert worker_url(cfg) == "http://127.0.0.1:30001"
    own = parse(base + "[router]\nenabled = true\nurl = 'http://r:1'\nworker_url = 'http://10.0.0.5:30001/'\n")
    assert worker_url(own) == "http://10.0.0.5:30001"
    assert "[router] url = \"\": must be set when enabled = true" in rejects(base + "[router]\nenabled = true\n")
    assert "[router] url = 'router:30080': must be the router's URL" in rejects(base + "[router]\nurl = 'router:30080'\n")
    assert "[router] timeout_s = 0: must be seconds > 0" in rejects(base + "[router]\ntimeout_s = 0\n")
    assert "did you mean 'token_file'" in rejects(base + "[router]\ntoken = 'secret'\n")
