"""The GEM-style network: sequence tower, user-ad cross attention, pooled attention, DHEN
experts and CTR/CVR heads, all on jagged inputs."""

from gem_platform.model.gem import GemModel

__all__ = ["GemModel"]
