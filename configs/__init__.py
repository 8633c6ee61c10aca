"""kvray.configs: pydantic configuration models and shipped presets (data, no code)."""

from kvray.configs.deployment import DeploymentConfig, KVTransferConfig, PoolConfig, RouterConfig

__all__ = ["DeploymentConfig", "KVTransferConfig", "PoolConfig", "RouterConfig"]
