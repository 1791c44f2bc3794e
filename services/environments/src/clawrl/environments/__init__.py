"""Track 2: agents that act. Sandboxes leased to agents over OpenClaw-RL's pool API
(`/allocate`, `/heartbeat`, `/reset`, `/exec_tool`, `/evaluate`, `/close`) on a local bubblewrap
backend or agent-sandbox claims on Kubernetes; the terminal task sets and their checkers; and the
agent runner that plays each task as a session through the gateway."""
