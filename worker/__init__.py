"""What prefill and decode workers share: the engine on its thread, the Ray
actor base, the output streams to the routers, process setup (cores,
scheduling policy, heap, log format)."""
