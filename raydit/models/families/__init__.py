"""Model families, found by `raydit.models.registry` (nothing lists them).

A module or a package here that defines `FAMILY` (a `raydit.models.family.Family`) is a family:
adding one is that package plus its conformance cases, which the shared suite runs. A package
reads in one sitting: `family.py` (the adapter and the Family), `tiny.py` (its tiny pipelines,
TINY_PIPELINES), `cases.py` (its conformance cases, conformance_cases(base_dirs)), and an
`__init__.py` that hands on FAMILY (mochi/, hunyuanvideo/, hunyuanvideo15/); the Family finds
tiny.py and cases.py by name, and they import the family, not the other way round. Family code
imports neither torch nor diffusers at its top level (the planner reads the families).
"""
