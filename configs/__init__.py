"""kvray.configs: pydantic configuration models and shipped presets (data, no code)."""

from kvray.configs.deployment import (
    DeploymentConfig,
    KVTransferConfig,
    PlannerConfig,
    PoolAutoscaling,
    PoolConfig,
    RouterConfig,
)
from kvray.configs.serve import ServeConfig

__all__ = [
    "DeploymentConfig",
    "KVTransferConfig",
    "PlannerConfig",
    "PoolAutoscaling",
    "PoolConfig",
    "RouterConfig",
    "ServeConfig",
]
