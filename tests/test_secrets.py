"""Secrets given as env= stay secret: never in an error, a repr or a file of the run
(docs/security.md, "Secrets stay in the environment")."""

from __future__ import annotations

import os

import pytest

from gpufleet import ConfigError, attach, distributed

pytestmark = pytest.mark.timeout(90)

SECRET = "s3cr3t-9c41d7e0aa"


def work():
    return 1


@pytest.mark.parametrize(
    "env, named",
    [
        ({"API_TOKEN": SECRET, "RETRIES": 3}, "RETRIES"),  # one value of the wrong type
        ({"API_TOKEN": SECRET, "PATH_NUL": "a\0b"}, "PATH_NUL"),  # no variable carries a NUL
        ({"API_TOKEN": SECRET, "": "x"}, "''"),
    ],
    ids=["int value", "NUL byte", "empty name"],
)
def test_a_bad_env_entry_is_named_without_showing_any_value(env, named, runs_dir):
    with pytest.raises(ConfigError) as info:
        distributed(gpus=2, env=env, runs_dir=runs_dir)(work)
    text = str(info.value)
    assert named in text, text
    assert SECRET not in text, text
    assert not runs_dir.exists(), "no run folder may be made for bad input"


def test_a_bad_runtime_env_shows_no_value():
    runtime_env = {"env_vars": {"API_TOKEN": SECRET}, 3: "not a name"}
    with pytest.raises(ConfigError) as info:
        distributed(remote=True, runtime_env=runtime_env)(work)
    assert SECRET not in str(info.value)
    with pytest.raises(ConfigError) as info:  # a cluster option without remote=True
        distributed(runtime_env={"env_vars": {"API_TOKEN": SECRET}})(work)
    assert "runtime_env" in str(info.value) and SECRET not in str(info.value)


def test_reprs_name_env_keys_but_mask_their_values():
    fn = distributed(gpus=2, env={"API_TOKEN": SECRET})(work)
    for text in (repr(fn), repr(fn.run_options), str(fn.options(gpus=1))):
        assert "API_TOKEN" in text and SECRET not in text, text


def test_a_submitted_run_keeps_env_off_disk_and_its_ranks_and_retries_get_it(runs_dir):
    def read_secret():
        from gpufleet import runtime

        if runtime.get_attempt() == 0:
            raise RuntimeError("first attempt fails, so the retry needs env= again")
        return os.environ["API_TOKEN"]

    # values together beyond what one environment variable may hold (128 KiB)
    bulky = {f"CERT_{i}": "c" * 60_000 for i in range(4)}
    run = distributed(gpus=2, env={"API_TOKEN": SECRET, **bulky}, runs_dir=runs_dir,
                      max_retries=1, logs="none")(read_secret).submit()
    assert run.result(timeout=80) == [SECRET, SECRET]

    files = [p for p in attach(run.id, runs_dir).path.rglob("*")
             if p.is_file() and p.parent.name != "results"]
    assert any(p.name == "call.pkl" for p in files), "the submitted call is kept in its folder"
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), f"{path} holds the env= value"
