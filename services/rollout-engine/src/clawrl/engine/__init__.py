"""clawrl rollout engine: the SGLang launcher for pods and a CPU inference engine that speaks
SGLang's native HTTP API."""
