"""The prefill pool: workers that read prompts and ship KV blocks to decode."""
