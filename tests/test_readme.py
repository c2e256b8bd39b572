"""The README is the product page: every command it shows exists with the flags it shows,
every concrete command parses, and every config it trains validates. At most 300 lines; it
points at nothing outside the repository."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from pipelines.config import load_config
from services.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_lines() -> list[tuple[str, str]]:
    """(section, command) for every ``proxydml`` line of the README's bash blocks, with a
    trailing comment and backslash continuations folded."""
    out, section = [], ""
    for block in re.finditer(r"^(## [^\n]*)$|```bash\n(.*?)```", README, re.M | re.S):
        if block.group(1):
            section = block.group(1)
            continue
        text = block.group(2).replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split("  #")[0].split(" # ")[0].strip()
            if line.startswith("proxydml "):
                out.append((section, line))
    return out


COMMANDS = _bash_lines()
SYNOPSIS = [line for section, line in COMMANDS if section == "## Commands"]
CONCRETE = [line for section, line in COMMANDS if section != "## Commands"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_the_readme_is_a_product_page():
    assert len(README.splitlines()) <= 300
    assert len(SYNOPSIS) >= 12 and len(CONCRETE) >= 8, (len(SYNOPSIS), len(CONCRETE))
    assert "shared/" not in README and "../" not in README


@pytest.mark.parametrize("line", SYNOPSIS)
def test_every_synopsis_command_and_flag_exists(line):
    """``proxydml stack backup DIR | restore DIR``: the words of each alternative name a
    subcommand (from the top, or a sibling of the previous one), and each ``--flag`` shown
    is one of its options."""
    root = build_parser()
    node = parent = root
    for alternative in line.removeprefix("proxydml ").split(" | "):
        tokens = alternative.split()
        if not tokens[0].startswith(("-", "[")):  # a (sub)command, not flags of the previous one
            base = root if tokens[0].split("|")[0] in _subparsers(root) else parent
            words = [t for t in tokens if re.fullmatch(r"[a-z][a-z|-]*", t)]
            for option in words[0].split("|"):  # list|show|rollback: siblings
                assert option in _subparsers(base), f"{option!r} is not a command under {base.prog}"
            parent, node = base, _subparsers(base)[words[0].split("|")[-1]]
            for word in words[1:]:
                options = word.split("|")
                if not all(o in _subparsers(node) for o in options):
                    break
                parent, node = node, _subparsers(node)[options[-1]]
        options = {o for a in node._actions for o in a.option_strings}
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", alternative):
            assert flag in options, f"{node.prog} has no {flag}"


@pytest.mark.parametrize("line", CONCRETE)
def test_every_concrete_command_parses_and_its_config_validates(line):
    argv = shlex.split(line)[1:]
    args = build_parser().parse_args(argv)
    if args.command == "train":
        cfg = load_config(args.config, args.overrides)  # the keys and values it shows are real
        assert cfg.run_name()
