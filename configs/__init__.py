"""kvray.configs: pydantic configuration models and shipped presets (data, no code)."""

from kvray.configs.deployment import DeploymentConfig, KVTransferConfig, PoolConfig, RouterConfig
from kvray.configs.serve import ServeConfig

__all__ = ["DeploymentConfig", "KVTransferConfig", "PoolConfig", "RouterConfig", "ServeConfig"]
