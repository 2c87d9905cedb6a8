"""``fairscale.optim`` on metadist."""

from metadist.compat.fairscale.optim.grad_scaler import GradScaler, ShardedGradScaler
from metadist.compat.fairscale.optim.oss import OSS

__all__ = ["OSS", "GradScaler", "ShardedGradScaler"]
