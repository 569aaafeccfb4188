"""The decode pool: workers that continue requests with continuous batching."""
