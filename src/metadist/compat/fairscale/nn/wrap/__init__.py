"""``fairscale.nn.wrap`` on metadist."""

from metadist.compat.fairscale.nn.wrap.auto_wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    wrap,
)

__all__ = ["auto_wrap", "config_auto_wrap_policy", "default_auto_wrap_policy", "enable_wrap",
           "wrap"]
