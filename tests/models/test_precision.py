"""raydit.models.precision: the bf16 rule's error measure, pure."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raydit.models.precision import BF16_ERROR_FACTOR, error_ratio, relative_error, within_bf16_rule


def test_relative_error_is_the_l2_norm_of_the_difference_over_the_reference():
    reference = torch.tensor([3.0, 4.0])  # norm 5
    assert relative_error(torch.tensor([3.0, 4.5]), reference) == pytest.approx(0.5 / 5)
    # bf16 against float64, numpy arrays: computed in float64 either way.
    assert relative_error(reference.to(torch.bfloat16), reference.double()) == 0.0
    assert relative_error(np.array([3.0, 3.0]), np.array([3.0, 4.0])) == pytest.approx(1 / 5)


def test_a_zero_reference_divides_by_nothing():
    zero = torch.zeros(3)
    assert relative_error(zero, zero) == 0.0
    assert relative_error(torch.tensor([0.0, 1e-30, 0.0]), zero) == math.inf
    assert error_ratio(0.0, 0.0) == 0.0 and error_ratio(1e-3, 0.0) == math.inf
    assert error_ratio(3e-3, 1.5e-3) == pytest.approx(2.0)


def test_the_rule_allows_twice_one_process_error_and_no_more():
    assert BF16_ERROR_FACTOR == 2.0
    assert within_bf16_rule(2e-3, 1e-3) and not within_bf16_rule(2.01e-3, 1e-3)
    assert within_bf16_rule(0.0, 0.0) and not within_bf16_rule(1e-9, 0.0)
    assert not within_bf16_rule(math.nan, 1e-3)


def test_shapes_must_match():
    with pytest.raises(ValueError, match=r"shapes differ: \(2,\) against the reference's \(3,\)"):
        relative_error(torch.zeros(2), torch.zeros(3))
