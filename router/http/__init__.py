"""The OpenAI-compatible HTTP front and Prometheus /metrics (FastAPI + uvicorn)."""

from .app import FrontState, create_app
from .server import HttpFront

__all__ = ["FrontState", "HttpFront", "create_app"]
