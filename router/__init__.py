"""kvray.router: the Router actor (worker choice, health, retries) and the Ray Serve app
(OpenAI ingress, handle API, metrics). `build_app` is imported on first use, so importing
the Router alone does not pull in FastAPI and Serve."""

from __future__ import annotations

__all__ = ["build_app"]


def __getattr__(name: str):
    if name == "build_app":
        from kvray.router.app import build_app

        return build_app
    raise AttributeError(f"module 'kvray.router' has no attribute {name!r}")
