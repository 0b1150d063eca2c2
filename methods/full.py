"""`full`: no compression; every token's K/V stays in the paged cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.methods.base import Method, register_method


@register_method("full")
@dataclass
class FullCache(Method):
    """The uncompressed baseline. A budget, if given, is recorded but never enforced."""
    supports_latent: ClassVar[bool] = True  # attention mass, positions or chance: defined on MLA's latent rows
