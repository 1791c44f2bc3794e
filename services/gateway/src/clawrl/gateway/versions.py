"""Which policy version a served turn is recorded with: the engine's weight_version (or the
LoRA adapter it was admitted under) against the pause gate's announcements. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.gateway.control import Admission


def policy_version_of(weight_version: str, gate_version: int) -> int:
    """The integer policy version of a turn: the engine's weight_version for its tokens when it
    is a number, else the version the pause gate announced (engines started with a name)."""
    try:
        return int(weight_version)
    except ValueError:
        return gate_version


def turn_versions(weight_version: str, admitted: Admission) -> tuple[int, str]:
    """(policy_version, weight_version) of a turn. Under a LoRA adapter: the admitted version
    and the adapter's name (the engine's weight_version names its base weights, and an
    adapter is never changed under a running request); else as policy_version_of."""
    if admitted.adapter:
        return admitted.policy_version, admitted.adapter
    return policy_version_of(weight_version, admitted.policy_version), weight_version


@dataclass(frozen=True)
class RecordedVersions:
    """The versions a main turn is recorded with."""

    policy_version: int  # of the weights that sampled its last tokens
    started_version: int  # of the weights its generation started under
    weight_version: str
    unknown_weights: bool  # the engine's weights are of no known version: never trained


def recorded_versions(
    first_weight_version: str,
    weight_version: str,
    admitted: Admission,
    *,
    paused_since: bool,
    base_version: int,
) -> RecordedVersions:
    """How a turn is recorded. `first_weight_version`: the engine's version on the first stream
    event ("" when not streamed); `paused_since`: a pause began while it was generated;
    `base_version`: the version the gateway calls weights the engine names (its start version).

    Only a sync retracts a generation, and a sync pauses every gateway first: without a pause
    meanwhile, the whole generation came from the weights reported at its end, whatever the
    gateway's own version. A named weight_version (SGLang's "default") under a gateway that has
    moved past its start version is an engine that lost the synced weights: unknown."""
    if admitted.adapter:
        return RecordedVersions(
            admitted.policy_version, admitted.policy_version, admitted.adapter, False
        )
    try:
        version = int(weight_version)
    except ValueError:
        unknown = admitted.policy_version != base_version
        return RecordedVersions(
            admitted.policy_version, admitted.policy_version, weight_version, unknown
        )
    started = version
    if paused_since:
        try:
            started = int(first_weight_version)
        except ValueError:  # not streamed: the version it was admitted under
            started = admitted.policy_version
    return RecordedVersions(version, started, weight_version, False)
