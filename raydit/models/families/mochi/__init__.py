"""Mochi 1: `family` (the adapter and the Family), `tiny` (the tiny pipeline), `cases` (the
conformance cases)."""

from raydit.models.families.mochi.family import FAMILY

__all__ = ["FAMILY"]
