"""A plugin for `test_plugins.py`: it records each install, and nothing else."""

installed: list[str] = []


def install(argument: str) -> None:
    installed.append(argument)
