"""docs/reference.md reads in the repository, where the README sends readers: it holds every
table (options, commands and their flags, workload fields, environment variables, exit
statuses) as the code makes them now, not only the markers the site's build fills in.

`python docs/hooks/reference.py` writes the tables into the page; this test fails when the
page is stale, e.g. after a flag or a command was added without writing them again.
"""

from __future__ import annotations

import importlib.util
import re

from support import REPO

PAGE = REPO / "docs" / "reference.md"


def _hook():
    spec = importlib.util.spec_from_file_location("reference_hook", REPO / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_holds_the_tables_the_code_makes():
    text = PAGE.read_text()
    assert _hook().render(text) == text, (
        "docs/reference.md is stale (or holds no tables): run python docs/hooks/reference.py "
        "and commit the page")


def test_the_committed_reference_names_every_option_command_field_and_exit_status():
    from gpufleet import cli
    from gpufleet.options import OPTIONS
    from gpufleet.runs.workload import FIELDS

    text = PAGE.read_text()
    missing = [f"option {n}" for n in OPTIONS if f'<span id="option-{n}"></span>`{n}=`' not in text]
    commands = cli._parser()._subparsers._group_actions[0].choices
    missing += [f"command {c}" for c in commands if f"### `gpufleet {c}`" not in text]
    missing += [f"field {f}" for f in FIELDS if f'<span id="field-{f}"></span>`{f}`' not in text]
    missing += [f"exit status {code}" for code in (0, *cli.EXIT_OF_STATUS.values())
                if f'<span id="exit-{code}"></span>`{code}`' not in text]
    assert not missing, f"docs/reference.md lacks: {', '.join(missing)}"
    # a table row, as GitHub shows it: no marker left unfilled, no table without its rows
    for marker in re.finditer(r"<!-- reference:([\w-]+) -->\n\n(.*?)\n", text):
        assert marker[2].startswith(("|", "###", "A workload", "Read from")), f"empty table {marker[1]}"
