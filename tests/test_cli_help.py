"""Command-line help a new user reads: every serve setting is reachable and named, with its default."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from qtts_cli.main import main
from serving.app import Settings
from serving.cli import add_serve_parser
from serving.settings import SERVE


def _serve_parser() -> argparse.ArgumentParser:
    return add_serve_parser(argparse.ArgumentParser().add_subparsers())


def test_serve_has_at_most_15_settings_each_a_flag_with_help_and_its_variable(monkeypatch):
    """Flags and QTTS_* variables together: each flag has a variable twin its help names, and no other variable
    is read (the tuning a user cannot judge is the engine's, from its measurements)."""
    actions = [a for a in _serve_parser()._actions if a.dest != "help"]
    assert {a.dest for a in actions} == set(SERVE) and len(SERVE) <= 15
    for a in actions:
        assert a.help and f"QTTS_{a.dest.upper()}" in a.help, a.option_strings
    for f in dataclasses.fields(Settings):
        if f.name in SERVE:
            monkeypatch.delenv(f"QTTS_{f.name.upper()}", raising=False)
        else:
            monkeypatch.setenv(f"QTTS_{f.name.upper()}", "1")
    assert Settings.from_env() == Settings()


def test_every_serve_flag_names_its_default():
    for action in _serve_parser()._actions:
        if action.dest != "help":
            assert "default" in (action.help or ""), action.option_strings


def test_qtts_jax_assembles_the_library_server_and_study_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "{synth,info,finetune,serve,cluster,study}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert capsys.readouterr().out.startswith("usage: qtts-jax serve")


def test_prefill_and_first_frame_widths_reach_the_engines_programs():
    config = Settings(slots=256, context=512).engine_config()
    assert (config.prefill_sizes, config.first_sizes) == ((1, 8, 32), (16, 64, 128))
    config = Settings(slots=256, context=512, engine={"max_prefill": 128, "max_first": 256}).engine_config()
    assert (config.prefill_sizes, config.first_sizes) == ((1, 8, 64, 128), (16, 64, 128, 256))
    with pytest.raises(ValueError, match="max_prefill"):
        Settings(engine={"max_prefill": 0}).engine_config()


def test_key_flags_and_variables_reach_the_settings_and_the_key_is_never_shown(monkeypatch):
    from serving.cli import settings_from_args

    parser = _serve_parser()
    monkeypatch.setenv("QTTS_API_KEY", "key-from-the-environment")
    monkeypatch.setenv("QTTS_PUBLIC_METRICS", "on")
    settings = settings_from_args(parser.parse_args([]))
    assert (settings.api_key, settings.public_metrics) == ("key-from-the-environment", True)
    assert "key-from-the-environment" not in repr(settings)  # what a log line of the settings would show
    assert settings_from_args(parser.parse_args(["--api-key", "@keys.txt"])).api_key == "@keys.txt"
    settings = settings_from_args(parser.parse_args(["--api-key", "none", "--public-metrics", "off"]))
    assert (settings.api_key, settings.public_metrics) == ("none", False)


def test_study_help_names_each_default_once(capsys):
    """argparse's defaults formatter printed "(default: X)" beside help that already named its default."""
    for command in ("capacity", "sustained", "fleet", "explore"):
        with pytest.raises(SystemExit):
            main(["study", command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for chunk in text.split("  --")[1:]:
            assert chunk.count("default") <= 1, chunk
    with pytest.raises(SystemExit):
        main(["study", "capacity", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--runs-dir RUNS_DIR parent directory of the run directory (default: runs)" in text
    assert "--price-per-hour PRICE_PER_HOUR fleet sizing: USD per replica-hour (default 1: a placeholder" in text


def test_fleet_says_when_its_price_is_the_placeholder(capsys):
    assert main(["study", "fleet", "--safe-capacity", "2", "--target", "10"]) == 0
    out = capsys.readouterr().out
    assert "7 replicas, $7.00/h" in out and "placeholder price $1" in out
    assert main(["study", "fleet", "--safe-capacity", "2", "--target", "10", "--price-per-hour", "2"]) == 0
    out = capsys.readouterr().out
    assert "7 replicas, $14.00/h" in out and "placeholder" not in out


def test_every_flag_of_every_command_has_help():
    from qtts_cli.main import build_parser
    from studies.cli import build_parser as study_parser

    def missing(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    yield from missing(p, f"{name} {sub}")
            elif action.dest != "help" and not action.help:
                yield f"{name} {'/'.join(action.option_strings) or action.dest}"

    assert not [*missing(build_parser(), "qtts-jax"), *missing(study_parser(), "qtts-jax study")]


def test_cluster_without_the_fleet_extra_names_a_make_target_that_exists(capsys, monkeypatch):
    import importlib.util
    import re
    from pathlib import Path

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    assert main(["cluster"]) == 2
    err = capsys.readouterr().err
    named = re.findall(r"\bmake ([a-z-]+)", err)
    targets = re.findall(r"^([a-z-]+):", (Path(__file__).parents[1] / "Makefile").read_text(), re.M)
    assert named and set(named) <= set(targets), (named, err)


def test_a_study_server_takes_serve_flags_and_engine_and_admission_fields_the_later_winning(monkeypatch):
    """`studies.server`'s command: the library configuration a benchmark varies beside `serve`'s flags; a policy's
    `--engine` given after `local_server`'s merges with it and wins where both name a field."""
    import serving.app
    from studies.server import main, server_command

    seen = []
    monkeypatch.setattr(serving.app, "run", lambda settings: seen.append(settings) or 0)
    command = server_command("--slots", "2", "--engine", '{"frames_per_step": 2, "lead_s": 0.3}',
                             engine={"frames_per_step": 1, "seeded_ends": True}, admission={"starvation_s": 1e9},
                             warmup=False)
    assert command[1:3] == ["-m", "studies.server"] and main(command[3:]) == 0
    (settings,) = seen
    assert settings.slots == 2 and settings.warmup is False
    assert settings.engine == {"frames_per_step": 2, "seeded_ends": True, "lead_s": 0.3}
    assert settings.engine_config().frames_per_step == 2 and settings.admission_config().starvation_s == 1e9
