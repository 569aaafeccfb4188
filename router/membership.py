"""The membership of a deployment: which workers it has, of which role, and a
generation that changes with every change, so that routers polling it see
one. Plain Python (no Ray): the deployment's controller
(router/pool_controller.py) keeps one, and tests drive it directly; what
routers get of it is the controller's snapshot (``Members``: each member
with its actor handle, at one generation).

Worker names are ``<role>-<12 hex digits>``: random, so that two routers, or
a deployment actor that restarted, never make the same name twice. The
membership can be rebuilt from those names alone (``from_names``): a
deployment actor that Ray restarted finds its workers among the named actors
of its namespace.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "colocated")
NAME_RE = re.compile(r"^(prefill|decode|colocated)-([0-9a-f]{12})$")


@dataclass(frozen=True)
class Member:
    name: str
    role: str


def new_worker_name(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"no worker role {role!r} (one of {', '.join(ROLES)})")
    return f"{role}-{secrets.token_hex(6)}"


def role_of(name: str) -> str | None:
    """The role in a worker's name; None for a name that is not a worker's."""
    found = NAME_RE.match(name)
    return found.group(1) if found else None


@dataclass
class Membership:
    """Workers by name, the replacements still owed per role (a lost worker whose
    replacement could not be placed yet), and the generation."""

    members: dict[str, Member] = field(default_factory=dict)
    missing: dict[str, int] = field(default_factory=dict)
    # A new epoch per instance: a rebuilt membership never repeats a generation
    # an older instance showed, even though its counter starts again.
    epoch: str = field(default_factory=lambda: secrets.token_hex(4))
    counter: int = 0

    @classmethod
    def from_names(cls, names: list[str]) -> Membership:
        """The membership of the workers named ``names`` (other names are ignored)."""
        m = cls()
        for name in names:
            role = role_of(name)
            if role is not None:
                m.members[name] = Member(name, role)
        return m

    @property
    def generation(self) -> str:
        return f"{self.epoch}:{self.counter}"

    def count(self, role: str) -> int:
        return sum(1 for m in self.members.values() if m.role == role)

    def names(self, role: str | None = None) -> list[str]:
        return [m.name for m in self.members.values() if role is None or m.role == role]

    def has(self, name: str) -> bool:
        return name in self.members

    def add(self, names: list[str]) -> None:
        """New workers, started: they join at one new generation."""
        for name in names:
            role = role_of(name)
            if role is None:
                raise ValueError(f"{name!r} is not a worker name (<role>-<12 hex digits>)")
            self.members[name] = Member(name, role)
        if names:
            self.counter += 1

    def remove(self, names: list[str]) -> list[str]:
        """Workers leaving (scaled away); returns those that were members."""
        gone = [n for n in names if self.members.pop(n, None) is not None]
        if gone:
            self.counter += 1
        return gone

    def lose(self, names: list[str]) -> list[Member]:
        """Workers lost: they leave, and each one's role is owed a replacement.
        A name that is no member (another router reported it first, or it was
        scaled away) owes nothing: one replacement per lost worker."""
        lost = [self.members.pop(n) for n in names if n in self.members]
        for member in lost:
            self.missing[member.role] = self.missing.get(member.role, 0) + 1
        if lost:
            self.counter += 1
        return lost

    def owe(self, role: str) -> None:
        """A replacement of ``role`` owed for a worker that was never a member
        here (one a restarted owner could not take over)."""
        self.missing[role] = self.missing.get(role, 0) + 1

    def owed(self) -> dict[str, int]:
        """Replacements owed, by role."""
        return {role: n for role, n in self.missing.items() if n > 0}

    def replaced(self, role: str, n: int) -> None:
        """``n`` replacements of ``role`` started (they were ``add``ed)."""
        self.missing[role] = max(0, self.missing.get(role, 0) - n)

    def resize(self, role: str) -> None:
        """An explicit size for ``role``: what was owed to it is settled by it."""
        self.missing.pop(role, None)
