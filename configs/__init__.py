"""kvray.configs."""
