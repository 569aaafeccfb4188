"""The serve config with a ``deployment`` section (name, attach), for the CLI's
tests: router/config.py's own once it has one (issue 26, the deployment
work), until then a stand-in with the same two fields."""

from __future__ import annotations

from pydantic import Field

from router.config import Section, ServeConfig


class DeploymentStandIn(Section):
    """deployment.name and deployment.attach, as router/config.py is to have them."""

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    attach: bool = False


class _WithDeployment(ServeConfig):
    deployment: DeploymentStandIn = Field(default_factory=DeploymentStandIn)


Config: type[ServeConfig] = (
    ServeConfig if "deployment" in ServeConfig.model_fields else _WithDeployment
)
