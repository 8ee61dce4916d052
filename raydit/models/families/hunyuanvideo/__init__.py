"""HunyuanVideo (T2V and I2V): `family` (the adapter and the Family), `tiny` (the tiny
pipelines), `cases` (the conformance cases)."""

from raydit.models.families.hunyuanvideo.family import FAMILY

__all__ = ["FAMILY"]
