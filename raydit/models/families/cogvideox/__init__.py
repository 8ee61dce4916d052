"""CogVideoX: `family` (the adapter and the Family), `tiny` (the tiny pipelines), `cases` (the
conformance cases)."""

from raydit.models.families.cogvideox.family import FAMILY

__all__ = ["FAMILY"]
