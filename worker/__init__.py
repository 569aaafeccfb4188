"""What prefill and decode workers share: the engine on its thread, the Ray
actor base, process setup (cores, scheduling policy, heap, log format)."""
