"""Cloud providers behind one protocol (:class:`~spotguard.providers.base.CloudProvider`).

``aws`` (EC2, boto3), ``gcp`` (Compute Engine, google-cloud-compute) and ``local`` (sandboxes
on this machine). SDKs are imported only when a provider is opened.
"""

from __future__ import annotations

from spotguard.config import load
from spotguard.errors import ConfigError
from spotguard.extras import require
from spotguard.providers.base import (
    CloudProvider,
    InstanceRef,
    InstanceState,
    InstanceTypeInfo,
    LaunchSpec,
    Market,
    Offer,
)
from spotguard.providers.gpus import canonical_gpu

__all__ = [
    "PROVIDERS",
    "CloudProvider",
    "InstanceRef",
    "InstanceState",
    "InstanceTypeInfo",
    "LaunchSpec",
    "Market",
    "Offer",
    "canonical_gpu",
    "open_provider",
]

PROVIDERS = ("aws", "gcp", "local")


def open_provider(name: str, config_file: str | None = None) -> CloudProvider:
    """The provider called ``name``, configured from its settings section."""
    if name in ("aws", "gcp"):
        require(name, f"provider {name}")  # the SDK is its extra: say so before importing
    if name == "aws":
        from spotguard.providers.aws import AwsProvider, AwsSettings

        return AwsProvider(load(AwsSettings, config_file=config_file))
    if name == "gcp":
        from spotguard.providers.gcp import GcpProvider, GcpSettings

        return GcpProvider(load(GcpSettings, config_file=config_file))
    if name == "local":
        from spotguard.providers.local import LocalProvider, LocalSettings

        return LocalProvider(load(LocalSettings, config_file=config_file))
    raise ConfigError(f"unknown provider {name!r} (known: {', '.join(PROVIDERS)})")
