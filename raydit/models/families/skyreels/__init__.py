"""SkyReels-V2: `family` (the adapter and the Family, on Wan's), `tiny` (the tiny pipelines),
`cases` (the conformance cases)."""

from raydit.models.families.skyreels.family import FAMILY

__all__ = ["FAMILY"]
