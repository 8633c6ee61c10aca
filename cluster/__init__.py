"""kvray.cluster."""
