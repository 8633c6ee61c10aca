"""kvray.router."""
