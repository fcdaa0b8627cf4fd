"""The performance and resilience guide (docs/guide.md) quotes only numbers that committed
benchmark results hold, and only names that gpufleet has.

The guide's conventions, which these tests enforce without starting any process:

- A *citation* is a link to a file under benchmarks/results/ whose text holds the numbers it
  quotes: ``a crash was reported in [0.74 s](../benchmarks/results/fault_recovery-....md)``.
  Every number in that text must occur in the linked file. A link whose text is the file's own
  name points at the file and quotes nothing.
- A *cited table* is one whose rows cite results, or whose caption (the paragraph right above
  it) does: every number in a body row must occur in a file the row cites, else in one the
  caption cites.
- A *computed* number shows its arithmetic in a code span, ``11.69 / 0.231 ≈ 51``: the result
  must be the arithmetic rounded to the digits shown, and every operand a number the guide
  cites (or a plain constant: a small count, 60, 100, 1000, 1024, 3600).
- Outside code, a number with a unit of measure (``s``, ``ms``, ``%``, ``GB``, ``GiB``,
  ``tokens/s``, ``×``, ...) must be cited, in a cited table, or the result of a computation in
  the same paragraph or list item. Defaults and settings are written as code
  (``grace_period=30``), and are checked as names instead.
- The paragraph of a citation (for a table: its row and caption) names the hardware the file
  was measured on: ``2 × H200`` for a file named ``*-2xH200-*``, ``CPU`` for ``*-cpu-*``.

A result file whose number changed, an invented or mistyped number, wrong arithmetic, a
measurement without its source and a missing hardware name each fail; the tests at the end feed
the checker such pages to show that they do.
"""

from __future__ import annotations

import ast
import functools
import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
GUIDE = DOCS / "guide.md"
RESULTS = REPO / "benchmarks" / "results"
SRC = REPO / "src" / "gpufleet"

# A number as the guide writes it: not part of a word (H200, fp32, FSDP2), commas for thousands.
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")
# In a result file anything that looks like a number counts (1.2b, 3m13.722s, #1).
FILE_NUMBER = re.compile(r"(?<![\d.])\d+(?:,\d{3})*(?:\.\d+)?")
# A unit of measure right after a number: that number is a measurement. "2 × H200" is hardware.
UNIT = re.compile(
    r"\s?(?:k\s?)?(?:ms|s|sec|seconds?|min|minutes?|h|hours?|%|GB/s|GB|GiB|MB|MiB|TB|bytes|steps|"
    r"tokens/s|samples/s|img/s|TFLOP/s|W|×(?!\s*[A-Z]+\d))(?![A-Za-z])"
)
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
FENCE = re.compile(r"^\s*(```|~~~)")
LIST_ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s")
TABLE_RULE = re.compile(r"^\s*\|?[\s:|-]+\|?\s*$")
CONSTANTS = {str(n) for n in range(1, 11)} | {"60", "100", "1000", "1024", "3600"}


def normal(number: str) -> str:
    return number.replace(",", "")


def numbers(text: str) -> list[str]:
    return [normal(m.group(0)) for m in NUMBER.finditer(text)]


@functools.cache
def file_numbers(path: Path) -> frozenset[str]:
    if not path.is_file():
        return frozenset()
    text = path.read_text(encoding="utf-8", errors="replace")
    return frozenset(normal(m.group(0)) for m in FILE_NUMBER.finditer(text))


@dataclass
class Block:
    """A paragraph, a list item, a heading or a table of the page (code blocks are none)."""

    kind: str
    first: int
    lines: list[str] = field(default_factory=list)

    @property
    def last(self) -> int:
        return self.first + len(self.lines) - 1

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def blocks(markdown: str) -> list[Block]:
    found: list[Block] = []
    current: Block | None = None
    fenced = False
    for number, line in enumerate(markdown.splitlines(), 1):
        if FENCE.match(line):
            fenced, current = not fenced, None
            continue
        if fenced or not line.strip():
            current = None
            continue
        kind = "table" if line.lstrip().startswith("|") else "heading" if line.startswith("#") else "text"
        new_item = kind == "text" and LIST_ITEM.match(line)
        if current is None or current.kind != kind or kind == "heading" or new_item:
            current = Block(kind, number)
            found.append(current)
        current.lines.append(line)
    return found


def evaluate(expression: str) -> float:
    """The value of arithmetic as the guide writes it: × ÷ · − √( ) and thousands commas."""
    for written, python in (("×", "*"), ("·", "*"), ("÷", "/"), ("−", "-"), ("√", "sqrt")):
        expression = expression.replace(written, python)
    expression = re.sub(r"(?<=\d),(?=\d{3})", "", expression)
    return _value(ast.parse(expression.strip(), mode="eval").body)


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        operations = {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}
        if type(node.op) in operations:
            return operations[type(node.op)]
        if isinstance(node.op, ast.Div):
            return left / right
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sqrt"
            and len(node.args) == 1 and not node.keywords):
        return math.sqrt(_value(node.args[0]))
    raise ValueError(f"not plain arithmetic: {ast.unparse(node)}")


class Checker:
    """The problems of a page written under the guide's conventions (module docstring)."""

    def __init__(self, docs: Path = DOCS, results: Path = RESULTS):
        self.docs, self.results = docs, results.resolve()
        self.problems: list[str] = []
        self.cited: set[str] = set()
        self.citations = 0

    def check(self, markdown: str) -> list[str]:
        found = blocks(markdown)
        computations = []
        for i, block in enumerate(found):
            where = f"line {block.first}"
            if block.kind == "table":
                self._table(block, self._caption(found, i))
            else:
                self._links(block.text, block.text, where)
                self._measurements(block.text, where)
            computations += [(where, span) for span in self._computations(block.text)]
        for where, span in computations:
            self._arithmetic(span, where)
        return self.problems

    # -- citations --------------------------------------------------------------------------

    def _result(self, target: str) -> Path | None:
        """The file under the results folder a link points at (None: another link)."""
        path = target.split("#")[0]
        if not path or "://" in path:
            return None
        resolved = (self.docs / path).resolve()
        return resolved if resolved.is_relative_to(self.results) else None

    def _sources(self, text: str) -> list[Path]:
        return [path for link in LINK.finditer(text) if (path := self._result(link.group(2)))]

    def _links(self, text: str, context: str, where: str) -> list[Path]:
        """Check the citations in ``text``; ``context`` must name their hardware."""
        cited = []
        for link in LINK.finditer(text):
            label, path = link.group(1), self._result(link.group(2))
            if path is None:
                continue
            cited.append(path)
            name = path.relative_to(self.results).as_posix()
            if not path.exists():
                self.problems.append(f"{where}: {link.group(2)} does not exist")
                continue
            self._hardware(path, name, context, where)
            if label.strip("` ") in (name, path.name):
                continue  # a pointer to the file, quoting nothing
            self.citations += 1
            for number in numbers(label):
                self._quoted(number, [path], where, f"[{label}]")
        return cited

    def _quoted(self, number: str, sources: list[Path], where: str, quote: str) -> None:
        self.cited.add(number)
        if not any(number in file_numbers(path) for path in sources):
            names = ", ".join(sorted({path.name for path in sources}))
            self.problems.append(f"{where}: {number} in {quote} is not in {names}")

    def _hardware(self, path: Path, name: str, context: str, where: str) -> None:
        gpus = re.search(r"(\d+)xH200", name)
        wanted = f"{gpus.group(1)} × H200" if gpus else "CPU" if re.search(r"(?i)\bcpu\b|-cpu-", name) else None
        if wanted is None:
            self.problems.append(f"{where}: the hardware of {name} is not in its name")
        elif wanted not in context:
            self.problems.append(f"{where}: a citation of {name} without '{wanted}' in its paragraph")

    # -- tables -----------------------------------------------------------------------------

    @staticmethod
    def _caption(found: list[Block], i: int) -> Block | None:
        if i > 0 and found[i - 1].kind == "text" and found[i].first - found[i - 1].last <= 2:
            return found[i - 1]
        return None

    def _table(self, table: Block, caption: Block | None) -> None:
        above = caption.text if caption else ""
        rows = table.lines
        header = rows[0] if len(rows) > 1 and TABLE_RULE.match(rows[1]) else ""
        skip = 2 if header else 0
        shared = self._sources(above)  # its citations are checked as the paragraph they are
        for n, row in enumerate(rows[skip:], table.first + skip):
            where = f"line {n}"
            sources = self._links(row, "\n".join((above, header, row)), where) or shared
            if not sources:
                self._measurements(row, where)
                continue
            shown = LINK.sub(lambda link: link.group(1), CODE_SPAN.sub(" ", row))
            for number in numbers(shown):
                self._quoted(number, sources, where, f"the table row {row.strip()!r}")

    # -- measurements outside citations, and computed numbers ---------------------------------

    def _prose(self, text: str) -> str:
        """What a reader sees outside citations and code."""
        def shown(link: re.Match) -> str:
            return " " if self._result(link.group(2)) else link.group(1)

        return CODE_SPAN.sub(" ", LINK.sub(shown, text))

    @staticmethod
    def _computations(text: str) -> list[str]:
        return [span.group(2) for span in CODE_SPAN.finditer(text) if "≈" in span.group(2)]

    def _measurements(self, text: str, where: str) -> None:
        computed = {numbers(span.split("≈", 1)[1])[0] for span in self._computations(text)
                    if numbers(span.split("≈", 1)[1])}
        prose = self._prose(text)
        for number in NUMBER.finditer(prose):
            if UNIT.match(prose, number.end()) and normal(number.group(0)) not in computed:
                self.problems.append(f"{where}: {number.group(0)}{UNIT.match(prose, number.end()).group(0)} "
                                     "is a measurement without a citation")

    def _arithmetic(self, span: str, where: str) -> None:
        expression, _, result = span.partition("≈")
        shown = NUMBER.search(result)
        if shown is None:
            self.problems.append(f"{where}: `{span}` gives no result")
            return
        for operand in numbers(expression):
            if operand not in self.cited and operand not in CONSTANTS:
                self.problems.append(f"{where}: {operand} in `{span}` is not a number the page cites")
        try:
            value = evaluate(expression)
        except (SyntaxError, ValueError, ZeroDivisionError) as exc:
            self.problems.append(f"{where}: `{span}` is not arithmetic ({exc})")
            return
        digits = len(shown.group(0).partition(".")[2])
        if abs(value - float(normal(shown.group(0)))) > 0.5 * 10**-digits + 1e-9:
            self.problems.append(f"{where}: `{span}`: the arithmetic gives {value:.6g}")


def check(markdown: str) -> list[str]:
    return Checker().check(markdown)


# -- the guide ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guide() -> str:
    return GUIDE.read_text(encoding="utf-8")


def test_every_number_of_the_guide_is_in_the_result_it_cites(guide):
    checker = Checker()
    assert checker.check(guide) == []
    assert checker.citations >= 40, "the guide's measured numbers are written as citations"


@pytest.mark.parametrize("section", [
    "Choosing DDP, FSDP or ZeRO", "Checkpoint cadence", "Data loading",
    "Batch size and gradient accumulation", "NCCL settings", "Restart and preemption patterns",
    "Diagnosing hangs and stragglers", "What is not measured yet",
])
def test_the_guide_has_its_sections(guide, section):
    assert f"\n## {section}\n" in guide


def slugify(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = LINK.sub(lambda link: link.group(1), heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    found, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            found.add(slugify(heading.group(1)))
    return found


def test_the_guide_links_to_pages_and_headings_that_exist(guide):
    broken = []
    for link in LINK.finditer(CODE_SPAN.sub(" ", guide)):
        target = link.group(2)
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        page = (DOCS / path).resolve() if path else GUIDE
        if not page.exists():
            broken.append(target)
        elif anchor and page.suffix == ".md" and page.is_relative_to(DOCS) and anchor not in anchors(page):
            broken.append(target)
    assert broken == []


# Keywords the guide quotes from other libraries: torch's AdamW(fused=True).
EXTERNAL_KEYWORDS = {"fused"}


def test_the_options_and_functions_the_guide_names_exist_in_gpufleet(guide):
    source = "\n".join(path.read_text(encoding="utf-8") for path in sorted(SRC.rglob("*.py")))
    spans = [span.group(2) for span in CODE_SPAN.finditer(guide)]
    missing = []
    for span in spans:
        for keyword in re.findall(r"(?<![\w.])([a-z_][a-z0-9_]*)=", span):
            if keyword not in EXTERNAL_KEYWORDS and not re.search(rf"\b{keyword}\b", source):
                missing.append(f"{keyword}=")
    modules = {"runtime": SRC / "runtime.py", "data": SRC / "data.py",
               "strategies": SRC / "strategies" / "__init__.py"}
    for module, name in re.findall(r"\b(runtime|data|strategies)\.([a-zA-Z_]\w*)", guide):
        if not re.search(rf"^(?:def|class) {name}\b|^{name} = ", modules[module].read_text(), re.M):
            missing.append(f"{module}.{name}")
    for name in re.findall(r"\bRun\w*Error\b", guide):
        if f"class {name}(" not in (SRC / "errors.py").read_text():
            missing.append(name)
    trainer = "\n".join(path.read_text() for path in (SRC / "strategies").glob("*.py"))
    for name in re.findall(r"\btrainer\.(\w+)", guide):
        if not re.search(rf"def {name}\b|self\.{name}\s*=", trainer):
            missing.append(f"trainer.{name}")
    checkpointer = (SRC / "checkpoint" / "__init__.py").read_text()
    for name in re.findall(r"\bckpt\.(\w+)", guide):
        if f"def {name}(" not in checkpointer:
            missing.append(f"ckpt.{name}")
    assert sorted(set(missing)) == []


# -- the checker fails on what it must catch ---------------------------------------------------

DIGEST = "../benchmarks/results/checkpoint_digest-1xH200-2026-12-01.md"
THROUGHPUT = "../benchmarks/results/fsdp_throughput-2xH200-2026-11-29.md"
FAULTS = "../benchmarks/results/fault_recovery-2xH200-2026-11-30.md"


def test_a_page_that_follows_the_conventions_passes():
    page = (
        f"On 2 × H200 a crash was reported in [0.74 s]({FAULTS}).\n\n"
        f"A save returned after [11.69 s]({DIGEST}) on 1 × H200, about 51 steps of the\n"
        f"[0.231 s]({THROUGHPUT}) step on 2 × H200 (`11.69 / 0.231 ≈ 51`).\n\n"
        f"Measured on 2 × H200 ([fsdp_throughput-2xH200-2026-11-29.md]({THROUGHPUT})):\n\n"
        "| strategy | model | GPUs | tokens/s per GPU |\n|---|---|---|---|\n"
        '| `"ddp"` | 124M | 1 | 453,193 |\n'
    )
    assert check(page) == []


@pytest.mark.parametrize("page, problem", [
    (f"On 2 × H200 a crash was reported in [0.123 s]({FAULTS}).", "0.123 in [0.123 s]"),
    ("On 2 × H200 a crash was reported in 0.74 s.", "0.74 s is a measurement without a citation"),
    (f"A crash was reported in [0.74 s]({FAULTS}).", "without '2 × H200'"),
    ("On 2 × H200 a crash took [0.74 s](../benchmarks/results/nothing-2xH200.md).", "does not exist"),
    (f"[11.69 s]({DIGEST}) on 1 × H200 and [0.231 s]({THROUGHPUT}) on 2 × H200: `11.69 / 0.231 ≈ 60`.",
     "the arithmetic gives 50.6"),
    (f"[11.69 s]({DIGEST}) on 1 × H200: `12.5 / 11.69 ≈ 1.07`.", "12.5 in `12.5 / 11.69 ≈ 1.07` is not"),
    (f"On 2 × H200 ([x]({THROUGHPUT})):\n\n| model | tokens/s |\n|---|---|\n| 124M | 453,194 |\n",
     "453194 in the table row"),
])
def test_the_checker_finds(page, problem):
    assert any(problem in found for found in check(page)), check(page)


def test_a_changed_result_file_fails_the_number_quoted_from_it(tmp_path):
    docs, results = tmp_path / "docs", tmp_path / "benchmarks" / "results"
    docs.mkdir()
    results.mkdir(parents=True)
    page = "A crash was reported in [0.74 s](../benchmarks/results/faults-2xH200.md) on 2 × H200."
    (results / "faults-2xH200.md").write_text("| SIGKILL | 0.74 | 0.83 |\n")
    assert Checker(docs, results).check(page) == []
    (results / "faults-2xH200.md").write_text("| SIGKILL | 0.77 | 0.83 |\n")
    file_numbers.cache_clear()
    assert Checker(docs, results).check(page) == [
        "line 1: 0.74 in [0.74 s] is not in faults-2xH200.md"
    ]
