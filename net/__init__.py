"""Authenticated sockets: cluster secret and TLS, framing helpers, local sockets."""
