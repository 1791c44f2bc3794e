"""Code shared by every clawrl service: settings, stream records, the SGLang client,
chat-template rendering, logging and metrics helpers."""
