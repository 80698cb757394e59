import tomllib
from pathlib import Path

import pytest

from memrad.config import SettingsError, default_settings_dict, known_keys, load_settings

REPO = Path(__file__).resolve().parents[2]


def test_the_documented_config_file_lists_every_key_with_its_default():
    data = tomllib.loads((REPO / "config" / "memrad.toml").read_text())
    flat = {f"{section}.{key}": value for section, table in data.items() for key, value in table.items()}
    assert flat == default_settings_dict()


def test_the_documented_config_file_names_every_environment_variable():
    text = (REPO / "config" / "memrad.toml").read_text()
    for key, f in known_keys().items():
        assert f.metadata["env"] in text, key


def test_precedence_defaults_then_file_then_env_then_flags(tmp_path):
    user = tmp_path / "memrad.toml"
    user.write_text("[server]\nport = 9000\nmax_queue = 3\n[engine]\nprefill_chunk = 64\n")
    env = {"MEMRA_PORT": "9100", "MEMRA_PREFILL_CHUNK": "128"}
    s = load_settings(flags={"server.port": 9200}, env=env, config_file=user)
    assert s.server.port == 9200           # flag beats env
    assert s.engine.prefill_chunk == 128   # env beats file
    assert s.server.max_queue == 3         # file beats default
    assert s.server.host == "127.0.0.1"    # default


def test_memra_config_names_the_user_file(tmp_path):
    user = tmp_path / "other.toml"
    user.write_text("[model]\nthreads = 3\n")
    assert load_settings(env={"MEMRA_CONFIG": str(user)}).model.threads == 3


def test_missing_default_user_file_is_fine_but_a_named_one_must_exist(tmp_path):
    load_settings(env={"XDG_CONFIG_HOME": str(tmp_path)})
    with pytest.raises(SettingsError, match="cannot read config file"):
        load_settings(env={"MEMRA_CONFIG": str(tmp_path / "nope.toml")})


@pytest.mark.parametrize("text, message", [
    ("[server]\nprot = 1\n", "unknown key 'server.prot'"),
    ("[server]\nport = 'x'\n", "server.port must be int"),
    ("[model]\ndevice = 'tpu'\n", "model.device must be one of auto, cpu, cuda"),
    ("[engine]\nprefill_chunk = 0\n", "engine.prefill_chunk must be >= 1"),
    ("server = 1\n", "must be a \\[section\\] table"),
    ("[server\n", "not valid TOML"),
])
def test_bad_config_files_say_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_settings(env={}, config_file=path)


def test_bad_environment_values_name_the_variable():
    with pytest.raises(SettingsError, match="environment variable MEMRA_PREFILL_CHUNK: engine.prefill_chunk must be int"):
        load_settings(env={"MEMRA_PREFILL_CHUNK": "big"})


def test_start_flags_beat_the_environment_and_every_flag_names_a_known_key(monkeypatch):
    from memrad.cli import FLAGS, _flag_overrides, _parser

    assert set(FLAGS.values()) <= set(known_keys())
    monkeypatch.setenv("MEMRA_REUSE_MODE", "exact")
    args = _parser().parse_args(["start", "--reuse-mode", "fast", "--prefill-chunk", "128"])
    s = load_settings(_flag_overrides(args), config_file=None)
    assert (s.reuse.mode, s.engine.prefill_chunk) == ("fast", 128)


def test_the_served_context_comes_from_the_flag_else_memra_context_else_the_models_default(monkeypatch):
    from memrad.cli import _flag_overrides, _parser

    assert load_settings(env={}).model.context == 0  # 0: the model's default (the default model: 32768)
    assert load_settings(env={"MEMRA_CONTEXT": "16384"}).model.context == 16384
    monkeypatch.setenv("MEMRA_CONTEXT", "16384")
    args = _parser().parse_args(["start", "--context", "8192"])
    assert load_settings(_flag_overrides(args), config_file=None).model.context == 8192
    with pytest.raises(SettingsError, match="environment variable MEMRA_CONTEXT: model.context must be >= 0"):
        load_settings(env={"MEMRA_CONTEXT": "-1"})


def test_the_per_name_cap_reaches_the_daemons_pool(loaded):
    from memrad.config import DiskSettings, PoolSettings, Settings
    from memrad.engine.build import engine_for

    assert Settings().pool.sessions_per_name == 16
    settings = Settings(pool=PoolSettings(max_sessions=32, max_bytes=10**8, sessions_per_name=3),
                        disk=DiskSettings(enabled=False))
    engine = engine_for(loaded["llama"], settings, 1)
    assert (engine.parking.pool.max_sessions, engine.parking.pool.sessions_per_name) == (32, 3)
