"""attnhub's plugin (entry point ``conformance = "attnhub_conformance.attnhub_plugin"`` in group
``attnhub``): adds ``attnhub conformance`` to attnhub's CLI through the ``attnhub_commands``
hook (the core never imports the suite). Importing this module imports neither pytest nor
torch: the runner is imported when the command runs."""

from __future__ import annotations

from attnhub.hookspecs import Command, hookimpl

HELP = "run the conformance suite; print the features x backends matrix"


def main(argv: list[str]) -> int:
    from attnhub_conformance.runner import main as run

    return run(argv)


@hookimpl
def attnhub_commands() -> list[Command]:
    return [Command("conformance", HELP, main)]
