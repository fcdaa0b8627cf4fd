"""User scripts run as `__main__` in a subprocess: closures, `python -c`, helper modules."""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

from support import Script, assert_all_gone, prefixed_ranks, rank_lines

pytestmark = pytest.mark.timeout(90)

CLOSURE_SCRIPT = """
import sys

from gpufleet import distributed, runtime

SCALE = 100  # a global of __main__, sent by value


def make_job(offset):
    history = {"offset": offset}  # captured by the closure

    @distributed(gpus=2, runs_dir=sys.argv[1])
    def job(x, *, bonus=0):
        runtime.setup(timeout=30)
        rank = runtime.get_global_rank()
        print(f"closure running with offset {history['offset']}", flush=True)
        return rank * SCALE + x + history["offset"] + bonus

    return job


if __name__ == "__main__":
    print("RESULTS", make_job(7).distributed(1, bonus=1000), flush=True)
"""


@pytest.mark.parametrize("how", ["script file", "python -c, no main guard"])
def test_closure_defined_in_main_runs_on_every_rank(how, tmp_path, run_script):
    runs = tmp_path / "runs"
    if how == "script file":
        result = run_script(CLOSURE_SCRIPT, runs)
    else:  # and without the `if __name__ == "__main__":` guard
        code = CLOSURE_SCRIPT.replace('if __name__ == "__main__":\n    print', "print")
        assert "__name__" not in code
        result = Script(["-c", code, runs], tmp_path).wait(60)

    assert result.returncode == 0, result.explain()
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert ast.literal_eval(line.removeprefix("RESULTS ")) == [1008, 1108]
    assert prefixed_ranks(result.stdout) == {0, 1}
    assert "closure running with offset 7" in rank_lines(result.stdout, 0)
    no_gpu = [ln for ln in result.stderr.splitlines() if re.search(r"\bgpu\b", ln, re.IGNORECASE)]
    assert len(no_gpu) == 1, "one line must say no GPU was found:\n" + result.stderr
    assert_all_gone(result.tree, what="processes of the script")


def test_function_from_a_helper_module_next_to_the_script(tmp_path, run_script):
    """`python scripts/run.py` from the project root, with the function in scripts/jobs.py:
    the function travels to the ranks even though its module is only importable because the
    script's folder is on the caller's sys.path."""
    scripts = tmp_path / "project" / "scripts"
    scripts.mkdir(parents=True)
    (scripts / "jobs.py").write_text(textwrap.dedent("""
        from gpufleet import runtime

        def square_rank(x):
            runtime.setup(timeout=30)
            return (runtime.get_global_rank() + 1) ** 2 + x
    """))
    (scripts / "run.py").write_text(textwrap.dedent("""
        import sys

        from gpufleet import distributed
        from jobs import square_rank

        print("RESULTS", distributed(gpus=2, runs_dir=sys.argv[1])(square_rank).distributed(10))
    """))

    result = run_script(scripts / "run.py", tmp_path / "runs", cwd=tmp_path / "project")

    assert result.returncode == 0, result.explain()
    assert "RESULTS [11, 14]" in result.stdout, result.explain()
    assert_all_gone(result.tree, what="processes of the script")

