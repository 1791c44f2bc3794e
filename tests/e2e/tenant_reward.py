"""The two-tenant isolation test's reward plug-in (loaded by the judge as
`tests.e2e.tenant_reward:alpha_pleases`).

Each turn's reward names its tenant: +1 for the turns of the API key `tenant-alpha`, -1 for
everyone else's. A trainer step's mean reward is then +1 exactly when every sample in it was
alpha's and -1 exactly when none was, so the trainer's step log shows whether an adapter's step
held another tenant's samples.
"""

from __future__ import annotations

from clawrl.common.tenants import key_tenant

ALPHA_KEY = "tenant-alpha"
ALPHA = key_tenant(ALPHA_KEY)


def alpha_pleases(turn) -> float:
    return 1.0 if turn.turn.tenant == ALPHA else -1.0
