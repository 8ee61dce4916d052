"""Model families: one module each, found by `raydit.models.registry` (nothing lists them).

A module here that defines `FAMILY` (a `raydit.models.family.Family`) is a family: adding
one is that file plus its conformance cases, which the shared suite runs. Modules here
import neither torch nor diffusers at their top level (the planner reads them).
"""
