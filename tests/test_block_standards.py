"""Prefect's own standard checks for a collection's blocks (as prefect-aws runs them):
description, documentation URL, a described field for every field, a code example."""

from __future__ import annotations

import pytest
from prefect.testing.standard_test_suites import BlockStandardTestSuite

from prefect_ray_lifecycle.blocks import MLflowServer, MLflowWebhook, RayCluster


class _Standard(BlockStandardTestSuite):
    @pytest.mark.skip(
        reason="the project publishes no logo, and the suite fetches it from the "
        "internet, which this machine and CI cannot reach"
    )
    def test_has_a_valid_image(self, block) -> None: ...


class TestMLflowServer(_Standard):
    @pytest.fixture
    def block(self):
        return MLflowServer


class TestMLflowWebhook(_Standard):
    @pytest.fixture
    def block(self):
        return MLflowWebhook


class TestRayCluster(_Standard):
    @pytest.fixture
    def block(self):
        return RayCluster
