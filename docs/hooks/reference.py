"""The tables of ``reference.md``, generated from the code: written into the page, so that it
reads in the repository, and made again whenever the site is built (an MkDocs hook).

``reference.md`` holds the prose and, per table, its markers with the table between them:
``<!-- reference:NAME -->`` ... ``<!-- /reference:NAME -->``. ``python docs/hooks/reference.py``
writes every table afresh into the page (``--check``: exit 1 when one is stale, as
``tests/test_reference.py`` checks); the site's build does the same in memory, so the site is
never stale. Each table is made from the definitions the program itself uses:

- ``options``: ``gpufleet.options.OPTIONS`` (the keyword, its flags, its workload field, whether
  ``config.yaml`` sets it, the default, the help text);
- ``commands``: the ``gpufleet`` command's argparse parser (``gpufleet.cli._parser``), walked
  command by command, every flag (the unlisted torchrun spellings too);
- ``workload``: the workload file's JSON Schema (``gpufleet.runs.workload.schema``);
- ``environment``: ``gpufleet._environ``'s registries of variables;
- ``exit-codes``: ``gpufleet.cli``'s ``EXIT_*`` codes, the meanings its docstring gives them and
  the run statuses ``EXIT_OF_STATUS`` maps to them.

A marker the hook does not know, a known one missing from the page, or an exit code without a
meaning fails the build (and the script).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

PAGE = "reference.md"
MARKER = re.compile(r"<!--\s*reference:([\w-]+)\s*-->")
# a table's markers and what lies between them (a page with the opening marker alone: none)
BLOCK = re.compile(r"<!--\s*reference:([\w-]+)\s*-->(?:.*?<!--\s*/reference:\1\s*-->)?", re.S)


def on_config(config):
    """Tables come from the checkout being documented, not from another installed copy."""
    src = str(Path(config["config_file_path"]).resolve().parent / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    return render(markdown) if page.file.src_uri == PAGE else markdown


def render(markdown: str) -> str:
    """``reference.md`` with every table between its markers made afresh from the code."""
    found = MARKER.findall(markdown)
    unknown = sorted(set(found) - set(TABLES))
    missing = sorted(set(TABLES) - set(found))
    if unknown or missing:
        raise PluginError(f"{PAGE}: unknown table markers {unknown}, missing {missing}; "
                          f"the markers are {', '.join(f'<!-- reference:{n} -->' for n in TABLES)}")
    return BLOCK.sub(lambda m: _between_markers(m.group(1)), markdown)


def _between_markers(name: str) -> str:
    return f"<!-- reference:{name} -->\n\n{TABLES[name]().rstrip()}\n\n<!-- /reference:{name} -->"


# ---------------------------------------------------------------------------- markdown


_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_SPECIAL = re.compile(r"([\\*_{}\[\]|])")  # what Markdown (with tables) lets a backslash escape


def _text(text: object) -> str:
    """Prose from the code (help texts, meanings) as Markdown that shows it as written: its
    `code spans` kept, every other character that Markdown would read escaped (a help text's
    ``{"excludes": [...]}`` is no attribute list, its ``|`` no cell border)."""
    text, parts, start = " ".join(str(text).split()), [], 0
    for span in _CODE_SPAN.finditer(text):
        parts += [_escaped(text[start:span.start()]), span.group(0)]
        start = span.end()
    return "".join(parts + [_escaped(text[start:])])


def _escaped(prose: str) -> str:
    return _SPECIAL.sub(r"\\\1", prose).replace("<", "&lt;")


def _cell(text: object) -> str:
    """Markdown for a table cell: one line (pipes inside code spans are no border)."""
    return " ".join(str(text).split())


def _code(text: object) -> str:
    text = str(text)
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _anchor(kind: str, name: str) -> str:
    return f'<span id="{kind}-{name}"></span>'


# ---------------------------------------------------------------------------- options


def _run_flags() -> dict[str, list[str]]:
    """Each option's flags as ``gpufleet run``'s parser has them (shown by ``--help``)."""
    from gpufleet.flags import PIP_REQUIREMENT

    run = dict((name, p) for name, _, p in _subcommands(_parser()))["run"]
    found: dict[str, list[str]] = {}
    for action in run._actions:
        if action.help != argparse.SUPPRESS:
            dest = "pip" if PIP_REQUIREMENT in action.option_strings else action.dest
            found.setdefault(dest, []).extend(action.option_strings)
    return found


def options_table() -> str:
    from gpufleet.options import OPTIONS

    run_flags = _run_flags()
    rows = []
    for name, o in OPTIONS.items():
        flags = run_flags.get(name, [])
        default = o.default_note or repr(o.default)
        rows.append((
            _anchor("option", name) + _code(f"{name}="),
            ", ".join(_code(f) for f in flags) or "—",
            _code(f"{name}:") if o.file else "—",
            "yes" if o.config else "—",
            _code(default),
            _text(o.help) + (" (remote runs only)" if o.remote_only else ""),
        ))
    return _table(("keyword", "`gpufleet run` flags", "workload field", "config.yaml", "default", "meaning"),
                  rows)


# ---------------------------------------------------------------------------- commands


def _parser() -> argparse.ArgumentParser:
    from gpufleet import cli

    return cli._parser()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each command, in the order ``--help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, helps.get(name, ""), p) for name, p in action.choices.items()]
    return []


def _value(action: argparse.Action) -> str:
    """What a flag takes: its metavar or choices; nothing for a switch."""
    if action.nargs == 0:
        return ""
    if action.choices:
        return " \\| ".join(_code(c) for c in action.choices)
    metavar = action.metavar if isinstance(action.metavar, str) else None
    return _code(metavar or action.dest.upper())


def _default(action: argparse.Action) -> str:
    default = action.default
    if default in (None, False, [], argparse.SUPPRESS) or action.nargs == 0:
        return ""
    return _code(default)


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "prog": prog}
    return text


def _rows(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> list[tuple[str, ...]]:
    """One row per flag of ``group`` (or argument); a flag argparse hides from ``--help`` (the
    torchrun spellings with underscores) joins the row of the flag it stands for."""
    hidden: dict[str, list[str]] = {}
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            hidden.setdefault(action.dest, []).extend(action.option_strings)
    rows = []
    for action in group._group_actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        if action.option_strings:
            names = [*action.option_strings, *hidden.pop(action.dest, [])]
            shown = ", ".join(_code(n) for n in names)
        else:
            shown = _code(action.metavar or action.dest)
        rows.append((shown, _value(action) if action.option_strings else "", _default(action),
                     _text(_help(action, parser.prog))))
    return rows


def _command_tables(parser: argparse.ArgumentParser) -> str:
    parts = []
    for group in parser._action_groups:
        rows = _rows(parser, group)
        if rows:
            parts.append(f"{group.title[0].upper() + group.title[1:]}:\n\n"
                         + _table(("flag or argument", "value", "default", "meaning"), rows))
    return "\n".join(parts)


def commands_tables() -> str:
    parser = _parser()
    parts = [f"### `{parser.prog}`\n\n{_text(parser.description)}\n\n{_command_tables(parser)}"]
    for name, summary, sub in _subcommands(parser):
        usage = " ".join(sub.format_usage().split()).removeprefix("usage: ")
        text = _text(sub.description or (summary[0].upper() + summary[1:] + "."))
        parts.append(f"### `{parser.prog} {name}`\n\n{text}\n\n```text\n{usage}\n```\n\n{_command_tables(sub)}")
    return "\n".join(parts)


# ---------------------------------------------------------------------------- workload file


def _kind(rule: dict) -> str:
    """A JSON Schema rule as a short phrase: "integer ≥ 1 or null", "one of pack, spread"."""
    if "anyOf" in rule:
        return " or ".join(_kind(r) for r in rule["anyOf"])
    if "enum" in rule:
        return "one of " + ", ".join(_code(json.dumps(v)) for v in rule["enum"])
    types = rule.get("type", "any")
    words = " or ".join(types) if isinstance(types, list) else types
    if "minimum" in rule:
        words += f" ≥ {rule['minimum']}"
    if "exclusiveMinimum" in rule:
        words += f" > {rule['exclusiveMinimum']}"
    if "pattern" in rule:
        words += f" matching {_code(rule['pattern'])}"
    if "items" in rule:
        words += f" of {_kind(rule['items'])}"
    if "additionalProperties" in rule and isinstance(rule["additionalProperties"], dict):
        words += f" of {_kind(rule['additionalProperties'])}"
    return words


def workload_table() -> str:
    from gpufleet.runs.workload import ENTRY_POINTS, schema

    properties = schema()["properties"]
    rows = []
    for name, rule in properties.items():
        rule = dict(rule)
        meaning = rule.pop("description", "")
        option = " (the option " + _code(f"{name}=") + f"; [all its surfaces](#option-{name}))"
        rows.append((_anchor("field", name) + _code(name), _kind(rule),
                     _text(meaning) + (option if not _is_entry(name) else "")))
    entries = ", ".join(_code(e) for e in ENTRY_POINTS)
    return (f"A workload file holds exactly one of {entries}; every other field is optional. "
            "The same rules as JSON Schema: `gpufleet schema`, "
            "[workload.schema.json](workload.schema.json).\n\n"
            + _table(("field", "value", "meaning"), rows))


def _is_entry(name: str) -> bool:
    from gpufleet.runs.workload import ENTRY_FIELDS

    return name in ENTRY_FIELDS


# ---------------------------------------------------------------------------- environment


def environment_tables() -> str:
    from gpufleet import _environ

    groups = (
        ("Read from your environment", _environ.USER_VARIABLES),
        ("Set for every rank", _environ.RANK_VARIABLES),
        ("Between gpufleet's own processes (set by gpufleet; listed so that none is a surprise "
         "in a rank's environment)", _environ.INTERNAL_VARIABLES),
    )
    parts = []
    for title, variables in groups:
        rows = [(_anchor("env", name) + _code(name), _text(meaning)) for name, meaning in variables]
        parts.append(f"{title}:\n\n" + _table(("variable", "meaning"), rows))
    return "\n".join(parts)


# ---------------------------------------------------------------------------- exit codes


def exit_codes() -> dict[int, str]:
    """Each exit code of ``gpufleet`` (0 and cli's ``EXIT_*``) and the meaning cli.py's
    docstring gives it; an ``EXIT_*`` code it does not explain is an error."""
    from gpufleet import cli

    codes = {0} | {v for k, v in vars(cli).items() if k.startswith("EXIT_") and isinstance(v, int)}
    text = " ".join((cli.__doc__ or "").split())
    listed = text.partition("Exit status:")[2]
    meanings = {int(m.group(1)): m.group(2).strip() for m in re.finditer(r"\b(\d+) ([^;]+?)(?:;|\.$)", listed)}
    unexplained = sorted(codes - set(meanings))
    if unexplained:
        raise PluginError(f"gpufleet/cli.py's docstring gives no meaning to exit codes {unexplained} "
                          "(its 'Exit status:' paragraph)")
    return {code: meanings[code] for code in sorted(codes | set(meanings))}


def exit_codes_table() -> str:
    from gpufleet import cli

    statuses: dict[int, list[str]] = {}
    for status, code in cli.EXIT_OF_STATUS.items():
        statuses.setdefault(code, []).append(str(getattr(status, "value", status)))
    rows = [(_anchor("exit", str(code)) + _code(code), _text(meaning),
             ", ".join(_code(s) for s in statuses.get(code, [])) or "—")
            for code, meaning in exit_codes().items()]
    return _table(("exit status", "meaning", "a run that ended"), rows)


TABLES = {
    "options": options_table,
    "commands": commands_tables,
    "workload": workload_table,
    "environment": environment_tables,
    "exit-codes": exit_codes_table,
}


def main(argv: list[str]) -> int:
    """``python docs/hooks/reference.py [--check]``: write the tables into ``docs/reference.md``
    from this checkout's code, or with ``--check`` say whether the page holds them as they are."""
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "src"))
    page = root / "docs" / PAGE
    text = page.read_text()
    fresh = render(text)
    if "--check" in argv:
        if fresh != text:
            print(f"{page} is stale: python docs/hooks/reference.py writes its tables", file=sys.stderr)
        return int(fresh != text)
    page.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
