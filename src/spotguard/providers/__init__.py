"""Cloud providers behind one protocol (:class:`~spotguard.providers.base.CloudProvider`).

``aws`` (EC2, boto3), ``gcp`` (Compute Engine, google-cloud-compute) and ``local`` (sandboxes
on this machine). SDKs are imported only when a provider is opened.
"""

from __future__ import annotations

from spotguard.config import Settings
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
    "provider_settings",
]

PROVIDERS = ("aws", "gcp", "local")


def provider_settings(name: str) -> type[Settings]:
    """The settings class of the provider called ``name`` (load it at the edge, then
    :func:`open_provider`)."""
    if name in ("aws", "gcp"):
        require(name, f"provider {name}")  # the SDK is its extra: say so before importing
    if name == "aws":
        from spotguard.providers.aws import AwsSettings

        return AwsSettings
    if name == "gcp":
        from spotguard.providers.gcp import GcpSettings

        return GcpSettings
    if name == "local":
        from spotguard.providers.local import LocalSettings

        return LocalSettings
    raise ConfigError(f"unknown provider {name!r} (known: {', '.join(PROVIDERS)})")


def open_provider(settings: Settings) -> CloudProvider:
    """The provider the loaded ``settings`` (of :func:`provider_settings`) configure."""
    if settings.section == "aws":
        from spotguard.providers.aws import AwsProvider, AwsSettings

        assert isinstance(settings, AwsSettings)
        return AwsProvider(settings)
    if settings.section == "gcp":
        from spotguard.providers.gcp import GcpProvider, GcpSettings

        assert isinstance(settings, GcpSettings)
        return GcpProvider(settings)
    if settings.section == "local":
        from spotguard.providers.local import LocalProvider, LocalSettings

        assert isinstance(settings, LocalSettings)
        return LocalProvider(settings)
    raise ConfigError(f"no provider is configured by {type(settings).__name__}")
