"""clawrl.gateway: the OpenAI-compatible endpoint agents talk to. It serves every request from
the policy engine with token fidelity and records each main turn for training."""
