"""Settings: defaults < config file < MEMRA_* environment < command-line flags.

Every key lives in exactly one frozen section dataclass; its default is the dataclass
default and `config/memrad.toml` documents it (a test keeps the two equal). Each key has
one environment variable, named in the field's metadata.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_ENV = "MEMRA_CONFIG"


class SettingsError(ValueError):
    """A config file, environment variable or flag holds a value memrad cannot use."""


def _key(default: Any, env: str) -> Any:
    return field(default=default, metadata={"env": env})


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = _key("127.0.0.1", "MEMRA_HOST")
    port: int = _key(8765, "MEMRA_PORT")
    max_queue: int = _key(16, "MEMRA_MAX_QUEUE")
    max_batch: int = _key(4, "MEMRA_MAX_BATCH")
    shutdown_grace_s: float = _key(10.0, "MEMRA_SHUTDOWN_GRACE_S")
    strict_model_names: bool = _key(False, "MEMRA_STRICT_MODEL_NAMES")
    max_connections: int = _key(256, "MEMRA_MAX_CONNECTIONS")
    header_timeout_s: float = _key(10.0, "MEMRA_HEADER_TIMEOUT_S")
    idle_timeout_s: float = _key(75.0, "MEMRA_IDLE_TIMEOUT_S")
    body_timeout_s: float = _key(60.0, "MEMRA_BODY_TIMEOUT_S")
    max_body_connections: int = _key(32, "MEMRA_MAX_BODY_CONNECTIONS")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    name: str = _key("default", "MEMRA_MODEL")
    device: str = _key("auto", "MEMRA_DEVICE")
    dtype: str = _key("auto", "MEMRA_DTYPE")
    threads: int = _key(0, "MEMRA_THREADS")
    weights: str = _key("auto", "MEMRA_WEIGHTS")
    context: int = _key(0, "MEMRA_CONTEXT")
    kv_dtype: str = _key("auto", "MEMRA_KV_DTYPE")


@dataclass(frozen=True, slots=True)
class EngineSettings:
    prefill_chunk: int = _key(256, "MEMRA_PREFILL_CHUNK")
    compile: str = _key("auto", "MEMRA_COMPILE")
    prefill_budget: int = _key(0, "MEMRA_PREFILL_BUDGET")
    batch_decode: str = _key("batched", "MEMRA_BATCH_DECODE")
    speculate: str = _key("auto", "MEMRA_SPECULATE")
    prefill_attention: str = _key("auto", "MEMRA_PREFILL_ATTENTION")


@dataclass(frozen=True, slots=True)
class PoolSettings:
    enabled: bool = _key(True, "MEMRA_REUSE_POOL")
    max_sessions: int = _key(32, "MEMRA_POOL_MAX_SESSIONS")
    sessions_per_name: int = _key(16, "MEMRA_POOL_SESSIONS_PER_NAME")
    max_bytes: int = _key(0, "MEMRA_POOL_MAX_BYTES")


@dataclass(frozen=True, slots=True)
class ReuseSettings:
    mode: str = _key("exact", "MEMRA_REUSE_MODE")


@dataclass(frozen=True, slots=True)
class AffinitySettings:
    enabled: bool = _key(True, "MEMRA_AFFINITY")
    longest_prefix: bool = _key(True, "MEMRA_LONGEST_PREFIX")


@dataclass(frozen=True, slots=True)
class ToolSettings:
    fallback: bool = _key(True, "MEMRA_TOOL_FALLBACK")


@dataclass(frozen=True, slots=True)
class DiskSettings:
    enabled: bool = _key(True, "MEMRA_DISK")
    max_bytes: int = _key(4 * 2**30, "MEMRA_DISK_MAX_BYTES")
    dir: str = _key("", "MEMRA_DISK_DIR")


@dataclass(frozen=True, slots=True)
class ControlSettings:
    socket: str = _key("", "MEMRA_SOCKET")
    record: str = _key("", "MEMRA_RECORD")


@dataclass(frozen=True, slots=True)
class LogSettings:
    level: str = _key("info", "MEMRA_LOG_LEVEL")
    max_bytes: int = _key(10 * 1024 * 1024, "MEMRA_LOG_MAX_BYTES")
    backups: int = _key(3, "MEMRA_LOG_BACKUPS")


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    api_key: str = _key("", "MEMRA_API_KEY")
    allowed_hosts: str = _key("", "MEMRA_ALLOWED_HOSTS")
    allowed_origins: str = _key("", "MEMRA_ALLOWED_ORIGINS")
    allow_remote_without_key: bool = _key(False, "MEMRA_ALLOW_REMOTE_WITHOUT_KEY")


@dataclass(frozen=True, slots=True)
class LimitSettings:
    max_body_bytes: int = _key(16 * 1024 * 1024, "MEMRA_MAX_BODY_BYTES")
    max_messages: int = _key(4096, "MEMRA_MAX_MESSAGES")
    max_tokens: int = _key(0, "MEMRA_MAX_TOKENS")
    max_reply_tokens: int = _key(4096, "MEMRA_MAX_REPLY_TOKENS")
    max_stop_chars: int = _key(256, "MEMRA_MAX_STOP_CHARS")
    max_schema_depth: int = _key(32, "MEMRA_MAX_SCHEMA_DEPTH")
    max_preparing_bytes: int = _key(64 * 1024 * 1024, "MEMRA_MAX_PREPARING_BYTES")
    grammar_compile_s: float = _key(60.0, "MEMRA_GRAMMAR_COMPILE_S")


@dataclass(frozen=True, slots=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    reuse: ReuseSettings = field(default_factory=ReuseSettings)
    affinity: AffinitySettings = field(default_factory=AffinitySettings)
    disk: DiskSettings = field(default_factory=DiskSettings)
    tools: ToolSettings = field(default_factory=ToolSettings)
    control: ControlSettings = field(default_factory=ControlSettings)
    log: LogSettings = field(default_factory=LogSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    limits: LimitSettings = field(default_factory=LimitSettings)


_CHOICES = {
    "model.device": ("auto", "cpu", "cuda"),
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.weights": ("auto", "float", "int4", "int8"),
    "model.kv_dtype": ("auto", "activations", "bfloat16"),
    "log.level": ("debug", "info", "warning", "error"),
    "reuse.mode": ("exact", "fast"),
    "engine.compile": ("auto", "wait", "on", "off"),
    "engine.batch_decode": ("batched", "rows"),
    "engine.speculate": ("auto", "off"),
    "engine.prefill_attention": ("auto", "memra", "torch"),
}
_MINIMUM = {
    "server.port": 0,
    "server.max_queue": 0,
    "server.max_batch": 1,
    "engine.prefill_budget": 0,
    "server.shutdown_grace_s": 0,
    "model.threads": 0,
    "model.context": 0,
    "engine.prefill_chunk": 1,
    "pool.max_sessions": 0,
    "pool.sessions_per_name": 1,
    "pool.max_bytes": 0,
    "limits.max_body_bytes": 1024,
    "limits.max_messages": 1,
    "limits.max_tokens": 0,
    "limits.max_reply_tokens": 0,
    "limits.max_stop_chars": 1,
    "limits.max_schema_depth": 2,
    "disk.max_bytes": 0,
}


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Settings)}  # type: ignore[misc]


def known_keys() -> dict[str, dataclasses.Field]:
    """Every setting as "section.key" -> its dataclass field."""
    return {
        f"{section}.{f.name}": f
        for section, cls in _sections().items()
        for f in dataclasses.fields(cls)
    }


def default_settings_dict() -> dict[str, Any]:
    return {key: f.default for key, f in known_keys().items()}


def _coerce(key: str, value: Any, origin: str) -> Any:
    kind = type(known_keys()[key].default)
    try:
        if kind is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(value)
                value = lowered in ("1", "true", "yes", "on")
            elif not isinstance(value, bool):
                raise ValueError(value)
        elif kind is int:
            if isinstance(value, bool) or isinstance(value, float):
                raise ValueError(value)
            value = int(value)
        elif kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            value = float(value)
        else:
            if not isinstance(value, str):
                raise ValueError(value)
    except ValueError:
        raise SettingsError(
            f"{origin}: {key} must be {kind.__name__}, got {value!r}"
        ) from None
    if key in _CHOICES and value not in _CHOICES[key]:
        raise SettingsError(f"{origin}: {key} must be one of {', '.join(_CHOICES[key])}, got {value!r}")
    if key in _MINIMUM and value < _MINIMUM[key]:
        raise SettingsError(f"{origin}: {key} must be >= {_MINIMUM[key]}, got {value!r}")
    return value


def read_config_file(path: Path) -> dict[str, Any]:
    """Flatten a TOML config file to {"section.key": value}, rejecting unknown keys."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise SettingsError(f"{path}: top-level key {section!r} must be a [section] table")
        for name, value in table.items():
            key = f"{section}.{name}"
            if key not in known_keys():
                raise SettingsError(
                    f"{path}: unknown key {key!r}; known keys: {', '.join(sorted(known_keys()))}"
                )
            flat[key] = _coerce(key, value, str(path))
    return flat


def read_environment(env: Mapping[str, str]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, f in known_keys().items():
        name = f.metadata["env"]
        if name in env and env[name] != "":
            flat[key] = _coerce(key, env[name], f"environment variable {name}")
    return flat


def user_config_path(env: Mapping[str, str]) -> Path:
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV])
    from memrad.paths import config_dir

    return config_dir() / "memrad.toml"


def load_settings(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> Settings:
    """Build Settings from the four layers; `flags` maps "section.key" to typed values.

    The user config file is `config_file`, else $MEMRA_CONFIG, else the platform config
    dir's memrad.toml; only an explicitly named file must exist.
    """
    env = os.environ if env is None else env
    merged = default_settings_dict()
    explicit = config_file is not None or bool(env.get(CONFIG_ENV))
    path = config_file if config_file is not None else user_config_path(env)
    if path.exists() or explicit:
        merged.update(read_config_file(path))
    merged.update(read_environment(env))
    for key, value in (flags or {}).items():
        if value is not None:
            if key not in known_keys():
                raise SettingsError(f"unknown setting {key!r}")
            merged[key] = _coerce(key, value, "command line")
    sections = {
        section: cls(**{k.split(".", 1)[1]: v for k, v in merged.items() if k.startswith(section + ".")})
        for section, cls in _sections().items()
    }
    return Settings(**sections)


def settings_as_dict(settings: Settings) -> dict[str, Any]:
    return dataclasses.asdict(settings)
