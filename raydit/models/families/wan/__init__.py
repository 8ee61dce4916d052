"""Wan 2.1 / 2.2: `family` (the adapter and the Family), `tiny` (the tiny pipelines), `cases`
(the conformance cases)."""

from raydit.models.families.wan.family import FAMILY

__all__ = ["FAMILY"]
