"""Kandinsky 5: `family` (the adapter and the Family), `tiny` (the tiny pipelines), `cases` (the
conformance cases)."""

from raydit.models.families.kandinsky5.family import FAMILY

__all__ = ["FAMILY"]
