"""config.toml, KVASIR_* variables and flags: precedence, sources, strict one-line errors, and the commands that read
their defaults through them (``kvasir node``, ``kvasir ring up``), all under a temporary XDG_CONFIG_HOME."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvasir.cli import build_parser, main
from kvasir.commands.config import fill_from_config
from kvasir.core.config import DEFAULTS, KEYS, env_name, load_config, without_config
from kvasir.core.errors import InputError


@pytest.fixture
def conf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The config file's path under a fresh XDG_CONFIG_HOME, with no KVASIR_* setting inherited."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    for name in [env_name(k) for k in KEYS] + ["KVASIR_CONFIG"]:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "xdg" / "kvasir" / "config.toml"
    path.parent.mkdir(parents=True)
    return path


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_no_file_gives_the_defaults(conf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config()
    assert config.path == conf and not config.file_found
    assert {k: (s.value, s.source) for k, s in config.settings.items()} == {
        k: (v, "default") for k, v in DEFAULTS.items()
    }
    assert cli(capsys, "config", "path") == (0, f"{conf}\n", "")


def test_file_then_env_then_flag(conf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf.write_text(
        'market = "https://market.example"\nrelay = "wss://relay.example"\nthreads = 3\n'
        'api_key_file = "keys"\nidentity = "~/node.pem"\nmemory_budget = "2GiB"\ngpu_layers = -1\n'
    )
    monkeypatch.setenv("KVASIR_THREADS", "5")
    monkeypatch.setenv("KVASIR_RELAY", "ws://127.0.0.1:9")
    config = load_config({"relay": "ws://10.0.0.1:1", "market": None})
    assert config["market"] == "https://market.example" and config.source("market") == "file"
    assert config["threads"] == 5 and config.source("threads") == "env"
    assert config["relay"] == "ws://10.0.0.1:1" and config.source("relay") == "flag"
    assert config["memory_budget"] == "2GiB" and config["gpu_layers"] == -1
    # Paths in the file: relative to its directory, ~ expanded.
    assert config["api_key_file"] == conf.parent / "keys"
    assert config["identity"] == Path.home() / "node.pem"


def test_show_prints_values_and_sources(
    conf: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    conf.write_text("threads = 3\n")
    monkeypatch.setenv("KVASIR_MARKET", "http://127.0.0.1:8080")
    code, out, _ = cli(capsys, "config", "show", "--json", "--memory-budget", "1GiB")
    shown = json.loads(out)
    assert code == 0 and shown["path"] == str(conf) and shown["file_found"] is True
    assert shown["settings"]["threads"] == {"value": 3, "source": "file"}
    assert shown["settings"]["market"] == {"value": "http://127.0.0.1:8080", "source": "env"}
    assert shown["settings"]["memory_budget"] == {"value": "1GiB", "source": "flag"}
    assert shown["settings"]["relay"] == {"value": None, "source": "default"}
    assert shown["settings"]["identity"]["value"].endswith("identity.pem")
    code, out, _ = cli(capsys, "config", "show")
    lines = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert code == 0 and set(lines) == set(KEYS)
    assert lines["threads"][1:] == ["3", "[file]"] and lines["market"][-1] == "[env]" and lines["relay"][1] == "-"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('threads = "4"\n', "threads: must be an integer, not '4'"),
        ("threads = 0\n", "threads: must be at least 1, not 0"),
        ("thread = 4\n", "unknown field 'thread'"),
        ('market = "market.example"\n', "market: 'market.example' must start with http:// or https://"),
        ('relay = "https://relay.example"\n', "relay: 'https://relay.example' must start with ws:// or wss://"),
        ('memory_budget = "lots"\n', "memory_budget: 'lots' is not a size"),
        ("gpu_layers = -2\n", "gpu_layers: must be at least -1, not -2"),
        ("threads = \n", "not TOML"),
    ],
)
def test_a_bad_file_is_one_line_and_exit_2(
    conf: Path, capsys: pytest.CaptureFixture[str], text: str, error: str
) -> None:
    conf.write_text(text)
    code, out, err = cli(capsys, "config", "show")
    assert code == 2 and out == ""
    assert err.startswith(f"kvasir config: error: {conf}: ") and error in err and err.count("\n") == 1
    # Every command that reads it refuses the same way, before doing anything.
    code, _, err = cli(capsys, "node", "--manifest", "ring.toml", "--rank", "0")
    assert code == 2 and error in err and err.count("\n") == 1


def test_bad_environment_names_the_variable(conf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASIR_THREADS", "four")
    with pytest.raises(InputError, match=r"^\$KVASIR_THREADS: must be an integer, not 'four'$"):
        load_config()
    monkeypatch.setenv("KVASIR_THREADS", "2")
    monkeypatch.setenv("KVASIR_MARKET", "ftp://x")
    with pytest.raises(InputError, match=r"^\$KVASIR_MARKET: market: 'ftp://x' must start with http"):
        load_config()


def test_kvasir_config_names_another_file(conf: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    other = tmp_path / "other.toml"
    monkeypatch.setenv("KVASIR_CONFIG", str(other))
    with pytest.raises(InputError, match="no such configuration file"):
        load_config()  # named explicitly, so its absence is an error (the default location's is not)
    other.write_text("threads = 7\n")
    conf.write_text("threads = 2\n")
    assert load_config()["threads"] == 7


def test_node_takes_market_and_relay_from_the_file(conf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf.write_text('market = "http://127.0.0.1:9"\nrelay = "ws://127.0.0.1:9"\n')
    # A bare `kvasir node` enrolls at the configured market (seen here by its enrollment's own check of a flag).
    code, _, err = cli(capsys, "node", "--ring-secret-file", str(conf.parent / "absent.secret"))
    assert code == 2 and "cannot read the ring secret file" in err
    # Given a window, the configured market does not turn it into an enrolling node.
    code, _, err = cli(capsys, "node", "--manifest", str(conf.parent / "absent.toml"), "--rank", "0")
    assert code == 2 and "--market starts an empty node" not in err and "absent.toml" in err
    code, _, err = cli(capsys, "node", "--model", "m.gguf")
    assert code == 2 and "pass --manifest and --rank" in err


def test_flags_win_and_unset_flags_are_filled(conf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf.write_text("threads = 3\ngpu_layers = 4\n")
    monkeypatch.setenv("KVASIR_API_KEY_FILE", "/etc/kvasir/keys")
    args = build_parser().parse_args(["ring", "up", "--gpu-layers", "0"])
    config = fill_from_config(args, ["threads", "gpu_layers", "api_key_file"])
    assert (args.threads, args.gpu_layers, args.api_key_file) == (3, 0, Path("/etc/kvasir/keys"))
    assert [config.source(k) for k in ("threads", "gpu_layers", "api_key_file")] == ["file", "flag", "env"]
    args = build_parser().parse_args(["node", "--manifest", "ring.toml", "--rank", "0"])
    fill_from_config(args, ["memory_budget", "gpu_layers", "identity"])
    assert (args.memory_budget, args.gpu_layers, args.identity) == ("4GiB", 4, None)


def test_local_ring_nodes_ignore_the_users_config(conf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `ring up` passes every setting its nodes need as a flag; a configured relay must not reroute their links.
    conf.write_text('relay = "wss://relay.example"\n')
    monkeypatch.setenv("KVASIR_IDENTITY", "/somewhere/key.pem")
    env = without_config(os.environ)
    assert env_name("identity") not in env and env["XDG_CONFIG_HOME"] == os.environ["XDG_CONFIG_HOME"]
    config = load_config(environ=env)
    assert all(s.source == "default" for s in config.settings.values())


def test_kvasir_id_shows_the_configured_key(conf: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # `kvasir id` prints the key a node would use: the configured one, not the default.
    conf.write_text('identity = "keys/node.pem"\n')
    # A configured key file is a named one: made only when asked (a typo in the file must not mint a new key).
    code, _, err = cli(capsys, "id", "--json")
    assert code == 2 and "keys/node.pem does not exist" in err
    code, out, _ = cli(capsys, "id", "--json", "--create-identity")
    assert code == 0 and json.loads(out)["file"] == str(conf.parent / "keys" / "node.pem")
    assert (conf.parent / "keys" / "node.pem").exists()
    code, out, _ = cli(capsys, "id", "--json", "--identity", str(tmp_path / "flag.pem"), "--create-identity")
    assert code == 0 and json.loads(out)["file"] == str(tmp_path / "flag.pem")
