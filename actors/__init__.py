"""kvray.actors."""
