"""Fixtures of the controller tests (see controller_helpers)."""

from controller_helpers import api_factory

__all__ = ["api_factory"]
