"""Shipped profiles (``NAME.json`` in this folder) and the loader that takes
a shipped profile's name or a profile file's path (``tandem plan
--profile-out`` writes one). ``tandem plan --profiles`` lists the names."""

from __future__ import annotations

from pathlib import Path

from planner.profile import Profile

PROFILE_SUFFIX = ".json"


def profile_names() -> list[str]:
    """The shipped profiles' names, sorted."""
    folder = Path(__file__).resolve().parent
    return sorted(path.name.removesuffix(PROFILE_SUFFIX) for path in folder.glob("*.json"))


def profile_path(name_or_path: str | Path) -> Path:
    """The file of a shipped profile by name, else the file at that path."""
    text = str(name_or_path)
    if text in profile_names():
        return Path(__file__).resolve().parent / (text + PROFILE_SUFFIX)
    path = Path(text).expanduser()
    if path.is_file():
        return path.resolve()
    raise FileNotFoundError(
        f"no profile {text!r}: neither a file nor a shipped profile "
        f"(shipped: {', '.join(profile_names()) or 'none'})"
    )


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name, else the profile file at that path; a
    FileNotFoundError lists the shipped names."""
    return Profile.load(profile_path(name_or_path))
