"""The policy served over HTTP (``expose_http_server``): megatron-core's OpenAI-compatible
endpoints in front of this backend's KV-cached sampler, so that agents and NeMo-Gym's model
servers can sample from the policy being trained (docs/serving.md)."""
