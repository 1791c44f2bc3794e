"""The versions a main turn is recorded with: masked as mixed only when a sync really retracted
its generation, never because the gateway's own version lagged the engine's; weights of no
known version (a restarted engine's base model) are marked, never labelled with a version."""

from clawrl.gateway.control import Admission
from clawrl.gateway.versions import RecordedVersions, recorded_versions


def test_a_gateway_lagging_the_engine_records_the_engines_version_unmixed():
    # Admitted under v1 while the engine already served v2 for the whole generation.
    versions = recorded_versions("2", "2", Admission(1), paused_since=False, base_version=0)
    assert versions == RecordedVersions(2, 2, "2", False)


def test_a_generation_a_sync_retracted_starts_under_the_older_version():
    streamed = recorded_versions("1", "2", Admission(1), paused_since=True, base_version=0)
    assert (streamed.started_version, streamed.policy_version) == (1, 2)
    whole = recorded_versions("", "2", Admission(1), paused_since=True, base_version=0)
    assert (whole.started_version, whole.policy_version) == (1, 2)
    # Paused, but the generation ran on one version throughout (not retracted).
    same = recorded_versions("2", "2", Admission(1), paused_since=True, base_version=0)
    assert (same.started_version, same.policy_version) == (2, 2)


def test_named_weights_are_unknown_once_the_gateway_moved_past_its_base_version():
    lost = recorded_versions("default", "default", Admission(3), paused_since=False, base_version=0)
    assert lost == RecordedVersions(3, 3, "default", True)
    base = recorded_versions("default", "default", Admission(0), paused_since=False, base_version=0)
    assert not base.unknown_weights and base.policy_version == 0


def test_an_adapters_turn_records_the_adapter_and_is_known():
    versions = recorded_versions(
        "0", "0", Admission(4, "policy-v4"), paused_since=True, base_version=0
    )
    assert versions == RecordedVersions(4, 4, "policy-v4", False)
