from __future__ import annotations

from pathlib import Path

import pytest

from ds4d.config import DEFAULT_CONFIG_FILE, Config, ConfigError, load_config, render_default_toml


def test_shipped_toml_documents_every_knob_exactly():
    assert DEFAULT_CONFIG_FILE.read_text() == render_default_toml()


def test_defaults_when_nothing_set(tmp_path: Path):
    loaded = load_config({}, config_file=None, environ={"DS4D_CONFIG": str(tmp_path / "absent.toml")})
    assert loaded.config == Config()
    assert set(loaded.sources.values()) == {"default"}
    assert loaded.non_default() == {}


def test_precedence_file_env_cli(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text('port = 9001\nprefill_chunk = 512\nmax_num_seqs = 4\nprefix_caching = false\n')
    loaded = load_config({"port": "9003", "max_context": None}, config_file=f,
                         environ={"DS4D_PREFILL_CHUNK": "256", "DS4D_PORT": "9002"})
    c = loaded.config
    assert (c.port, c.prefill_chunk, c.max_num_seqs) == (9003, 256, 4)
    assert loaded.sources["port"] == "cli"
    assert loaded.sources["prefill_chunk"] == "env"
    assert loaded.sources["max_num_seqs"] == "file"
    nd = loaded.non_default()
    assert nd["prefix_caching"]["debug"] is True and nd["port"]["debug"] is False


def test_config_is_frozen():
    with pytest.raises(Exception):
        Config().port = 1  # type: ignore[misc]


@pytest.mark.parametrize("env,msg", [
    ({"DS4D_PORT": "eighty"}, "port"),
    ({"DS4D_PREFIX_CACHING": "maybe"}, "prefix_caching"),
    ({"DS4D_DTYPE": "float8"}, "dtype"),
    ({"DS4D_PREFILL_CHUNK": "0"}, "prefill_chunk"),
])
def test_bad_values_are_named(tmp_path: Path, env, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config({}, environ={"DS4D_CONFIG": str(tmp_path / "none.toml"), **env})


def test_unknown_file_knob_is_an_error(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("prefil_chunk = 3\n")
    with pytest.raises(ConfigError, match="unknown knob 'prefil_chunk'"):
        load_config({}, config_file=f, environ={})


def test_list_knob_from_env_and_cli(tmp_path: Path):
    env = {"DS4D_CONFIG": str(tmp_path / "none.toml"), "DS4D_API_KEYS": "a,b"}
    assert load_config({}, environ=env).config.api_keys == ("a", "b")
    assert load_config({"api_keys": ["k1", "k2"]}, environ=env).config.api_keys == ("k1", "k2")
