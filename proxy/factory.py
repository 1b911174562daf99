"""The engine and tenant rules a configuration describes: one factory for the live
proxy, the detector process, ``crosstalk replay`` and the benchmarks, so all detect alike.
"""

from __future__ import annotations

from pathlib import Path

from proxy.config import Config, ConfigError
from proxy.defaults import load_baseline, load_first_names, load_surnames, load_vocabulary
from proxy.engine import Engine, EngineConfig
from proxy.engine.baseline import Baseline, BaselineError
from proxy.tenants import TenantRules, load_jwt_key


def word_lists(config: Config) -> tuple[list[str], list[str]]:
    """The baseline texts and plain words ``config`` names (``detection.baseline_dir``,
    ``vocabulary_dir``, else the shipped ones). ConfigError for a configured directory
    that does not exist."""
    try:
        return (
            load_baseline(config.detection.baseline_dir),
            load_vocabulary(config.detection.vocabulary_dir),
        )
    except ValueError as e:
        raise ConfigError(f"detection: {e}") from e


def build_engine(
    config: Config,
    engine_config: EngineConfig | None = None,
    *,
    lists: tuple[list[str], list[str]] | None = None,
) -> Engine:
    """The engine ``config`` describes, with its word lists (``word_lists``, or ``lists``
    already read) and baseline files. ``engine_config`` replaces the parameters the
    configuration gives (the probe uses a fresh key). ConfigError for a configured
    directory or baseline file that cannot be used."""
    baseline, vocabulary = lists or word_lists(config)
    engine = Engine(
        engine_config or config.engine_config(),
        baseline=baseline,
        plain_words=vocabulary,
        surnames=load_surnames(),
        first_names=load_first_names(),
    )
    for path in config.detection.baselines:
        try:
            engine.add_baseline_file(Baseline.load(path))
        except BaselineError as e:
            raise ConfigError(f"detection.baselines: {e}") from e
    return engine


def tenant_rules(config: Config, secret: bytes) -> TenantRules:
    """How requests are attributed to tenants; ``secret`` keys the pseudonyms of
    unmapped API keys (the engine's key, so they are stable under a fixed key).
    ConfigError for a JWT key file that cannot be used."""
    t = config.tenants
    jwt_key = None
    if t.jwt_key_file:
        try:
            jwt_key = load_jwt_key(Path(t.jwt_key_file).read_bytes(), t.jwt_algorithms)
        except (OSError, ValueError) as e:
            raise ConfigError(f"tenants.jwt_key_file {t.jwt_key_file}: {e}") from None
    return TenantRules(
        sources=t.sources,
        header=t.header,
        api_keys=dict(t.api_keys),
        secret=secret,
        trusted_peers=t.trusted_peers,
        gateway_header=t.gateway_header,
        gateway_secret=t.gateway_secret,
        jwt_key=jwt_key,
        jwt_algorithms=t.jwt_algorithms,
        jwt_claim=t.jwt_claim,
        jwt_audience=t.jwt_audience,
        jwt_issuer=t.jwt_issuer,
    )
